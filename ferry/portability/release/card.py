"""The model card of a release (its README.md), written from the release's own record.

It says what the release holds and how to use it: the stage chain with each stage's final figures, how to load
a stage (ferry or transformers), how to continue from any stage, how to verify and replay the release, and the
one `ferry eval` command that recomputes each stage's held-out figures.
"""

from __future__ import annotations

from typing import Any

_FIGURES = (
    ("eval/rewards/accuracy", "reward accuracy"),
    ("eval/solve_rate", "solve rate"),
    ("eval/greedy_solve_rate", "greedy solve rate"),
)


def model_card(release: dict[str, Any]) -> str:
    pipeline = release["pipeline"]
    stages = release["stages"]
    code = release["code"]
    commit = (
        f" at commit `{code['git_commit']}`" + (" (with uncommitted changes)" if code.get("git_dirty") else "")
        if code.get("git_commit")
        else ""
    )
    lines = [
        f"# {pipeline['name']}: a ferry {'run' if pipeline.get('kind') == 'run' else 'pipeline'} release",
        "",
        f"Trained by ferry {code['ferry']}{commit} in {len(stages)} stage(s). This directory holds every stage's final "
        "checkpoint (ferry's neutral format: safetensors plus a JSON manifest), its resolved config, run record and "
        "metrics, the lineage that chains the stages by checkpoint digest, the manifest of every dataset"
        + (" and the data itself" if release["data_files"] else "")
        + ", and `release.json`, which lists every file with its size and sha256.",
        "",
        "The commands below run from this directory (from elsewhere, put its path before each path they name). None "
        "of them writes inside it: a replay or a branch works beside it unless told where, so `ferry release verify "
        ".` passes after any of them.",
        "",
        "## Intended use",
        "",
        "Research on training portability: checking the recorded curves on other hardware, and branching new "
        "training from any stage. The figures below are those of the recorded run; they say nothing about fitness "
        "for any application.",
        "",
        "## Stages",
        "",
        "| stage | objective | starts from | steps | final loss | held-out | checkpoint | transformers |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for stage in stages:
        result = stage["result"]
        loss = f"{result['loss']:.4f}" if result.get("loss") is not None else "-"
        export = stage["export"]
        exported = f"`{export['path']}` ({export['arch']})" if export.get("path") else "none"
        lines.append(
            f"| {stage['name']} | {stage['objective']} | {_start(stage)} | {result['step']} | {loss} | "
            f"{held_out(result) or '-'} | `{stage['checkpoint']['path']}` | {exported} |"
        )
    skipped = [(stage["name"], stage["export"]["skipped"]) for stage in stages if "skipped" in stage["export"]]
    if skipped:
        lines += ["", "Not exported to transformers: " + "; ".join(f"{name}: {why}" for name, why in skipped)]
    lines += ["", "## Data", "", "| source | tokens | manifest sha256 | licence | used by |", "|---|---|---|---|---|"]
    for source in release["data"]:
        used = ", ".join(
            f"{use['stage']} ({use['role']}"
            + (f", weight {use['weight']:g})" if use.get("weight") is not None else ")")
            for use in source["used_by"]
        )
        tokens = f"{source['tokens']:,}" if isinstance(source.get("tokens"), int) else "-"
        lines.append(
            f"| {source['name']} (`{source['dir']}`) | {tokens} | `{source['manifest_sha256'][:16]}` | "
            f"{source.get('licence') or 'not recorded'} | {used} |"
        )
    first, last = stages[0], stages[-1]
    checkpoints = f"{last['dir']}/checkpoints"
    lines += [
        "",
        "## Verify",
        "",
        "```sh",
        "ferry release verify .          # every file's sha256 and the chain of stage digests; exit 0 pass, 1 fail",
        "```",
        "",
        "## Load",
        "",
        "```sh",
        f"ferry generate {checkpoints} --prompt 'def '      # ferry, from the neutral checkpoint",
        "```",
    ]
    if last["export"].get("path"):
        lines += [
            "",
            "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            f"model = AutoModelForCausalLM.from_pretrained('{last['export']['path']}')",
            f"tokenizer = AutoTokenizer.from_pretrained('{last['export']['path']}')",
            "```",
        ]
    data = (
        "with the release's own copy of its data"
        if release["data_files"]
        else "with its data read where the stage's config names it, checked against the manifest the release records "
        "(this release carries the manifests only; `ferry release --data` carries the data too)"
    )
    lines += [
        "",
        "The checkpoint can also be read without ferry or torch: `safetensors` and `json` alone "
        "(docs/checkpoint-format.md).",
        "",
        "## Continue from any stage",
        "",
        f"Train a new run from any stage: its config, {data}, starting from its final checkpoint's weights"
        + _optimizer_words(stages)
        + ". `--out DIR` says where the run goes; `KEY=VALUE` overrides follow, as for `ferry train`; a stage of a "
        "new pipeline starts from a checkpoint here with `init_from: <path>`.",
        "",
        "```sh",
    ]
    lines += [f"ferry release branch . --stage {stage['name']}" for stage in stages]
    lines += [
        "```",
        "",
        "## Replay",
        "",
        "Train a stage's first steps again from this release alone (its parent checkpoint, config and data) and judge "
        "the curve against the recorded one under the rehearsal's tolerance profiles; `--env` names the environment "
        "to replay on (configs/environments/), which chooses the profile as `ferry rehearse` does. A stage that "
        "samples its own data (GRPO) is judged on its reward against the spread between runs with other seeds: the "
        "release's own where it carries them (`ferry release --seed-runs`: `seed_runs` in release.json), otherwise "
        "trained by the replay first.",
        "",
        "```sh",
        f"ferry release replay . --stage {first['name']} --steps 30",
        f"ferry release replay . --stage {first['name']} --steps 30 --env cpu-ep2",
        "```",
    ]
    evals = [stage for stage in stages if stage["eval_data"]]
    if evals:
        lines += ["", "## Recompute the held-out figures", "", "```sh"]
        for stage in evals:
            sources = {source["key"]: source for source in release["data"]}
            data = " ".join(_data_dir(sources.get(use["source"]), use) for use in stage["eval_data"])
            reference = ""
            if stage["objective"] == "dpo" and (stage.get("parent") or {}).get("stage"):
                reference = f" --reference stages/{stage['parent']['stage']}/checkpoints"  # its DPO reference
            lines.append(
                f"ferry eval {stage['dir']}/checkpoints --data {data}{reference}   # {held_out(stage['result'])}"
            )
        lines.append("```")
    lines += ["", "## Files", "", "`release.json` lists every file of this directory with its size and sha256.", ""]
    return "\n".join(lines)


def held_out(result: dict[str, Any]) -> str:
    figures = result.get("eval") or {"eval.loss": result.get("eval_loss") or {}}
    parts = [f"{name} loss {value:.4f}" for name, value in (figures.get("eval.loss") or {}).items()]
    for key, label in _FIGURES:
        parts += [f"{name} {label} {value:.1%}" for name, value in (figures.get(key) or {}).items()]
    return ", ".join(parts)


def _start(stage: dict[str, Any]) -> str:
    parent = stage.get("parent")
    if parent is None:
        return "scratch"
    start = stage["start"]
    source = parent.get("stage") or start["init_from"]
    return f"{source} @ {parent['step']} (`{parent['digest'][:12]}`), {start['carry']}"


def _data_dir(source: dict[str, Any] | None, use: dict[str, Any]) -> str:
    if source is not None and source["files_included"]:
        return source["dir"]
    return source["path"] if source is not None else use["name"]


def _optimizer_words(stages: list[dict[str, Any]]) -> str:
    """What a branch starts from besides the weights: each carried checkpoint's optimizer state, by the kind its
    manifest records (`AdamW`, `Muon`)."""
    by_kind: dict[str, list[str]] = {}
    for stage in stages:
        checkpoint = stage["checkpoint"]
        if checkpoint["optimizer"]:
            by_kind.setdefault(checkpoint.get("optimizer_kind") or "optimizer", []).append(stage["name"])
    if not by_kind:
        return " (this release carries no optimizer state)"
    if len(by_kind) == 1:
        return f" and {next(iter(by_kind))} state"
    return (
        " and optimizer state (" + "; ".join(f"{kind} for {', '.join(names)}" for kind, names in by_kind.items()) + ")"
    )
