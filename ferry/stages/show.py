"""`ferry pipeline show DIR`: the lineage of a pipeline directory as a table."""

from __future__ import annotations

from pathlib import Path

from ferry.stages.lineage import Lineage


def lineage_lines(directory: str | Path) -> list[str]:
    data = Lineage.read(Path(directory))
    pipeline = data["pipeline"]
    lines = [
        f"pipeline {pipeline['name']} ({pipeline['file']}, sha256 {pipeline['sha256'][:12]}), "
        f"{len(data['stages'])} stage(s)"
    ]
    rows = [("stage", "status", "starts from", "steps", "loss", "held-out", "checkpoint")]
    for stage in data["stages"]:
        result = stage.get("result") or {}
        held_out = _held_out(result)
        rows.append(
            (
                stage["name"],
                stage["status"],
                _start(stage),
                str(result.get("step", "-")),
                f"{result['loss']:.4f}" if result.get("loss") is not None else "-",
                held_out or "-",
                f"{result['checkpoint']} ({result['digest'][:12]})" if result else "-",
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines += ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    for stage in data["stages"]:
        code = stage["code"]
        data_mix = ", ".join(
            f"{source['name']} x{source['weight']:g} ({(source['manifest_sha256'] or '?')[:12]})"
            for source in stage["data"]
        )
        lines.append(
            f"  {stage['name']}: seed {stage['seed']}, data {data_mix}, ferry {code['ferry']}"
            + (
                f" @ {code['git_commit'][:12]}{'+dirty' if code.get('git_dirty') else ''}"
                if code.get("git_commit")
                else ""
            )
        )
    return lines


def _held_out(result: dict) -> str:
    """The stage's last held-out figures: loss per source, or DPO's reward accuracy, or GRPO's solve rates."""
    figures = result.get("eval") or {"eval.loss": result.get("eval_loss") or {}}
    parts = [f"{name} {loss:.4f}" for name, loss in figures.get("eval.loss", {}).items()]
    for key, label in (
        ("eval/rewards/accuracy", "reward acc"),
        ("eval/solve_rate", "solved"),
        ("eval/greedy_solve_rate", "greedy"),
    ):
        parts += [f"{name} {label} {value:.1%}" for name, value in figures.get(key, {}).items()]
    return ", ".join(parts)


def _start(stage: dict) -> str:
    parent = stage.get("parent")
    if parent is None:
        return "scratch"
    start = stage["start"]
    source = f"{parent['stage']}" if parent.get("stage") else start["init_from"]
    what = start["carry"] + (", steps continue" if start["steps"] == "continue" else "")
    lr = ", lr from parent" if start.get("lr") == "parent" else ""
    return f"{source} @ step {parent['step']} ({parent['digest'][:12]}): {what}{lr}"
