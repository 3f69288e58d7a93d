"""`ferry drill`: a failure drill. The same job twice, once uninterrupted and once under supervision
with faults injected on a random schedule; the drill passes when the supervised job ends in exactly
the state of the uninterrupted one.

Faults arrive as failures do, at exponentially distributed intervals (a Poisson process, from
`--seed`), of a kind and on a rank drawn at random: kill, hang, raise, poisoned gradients, a
corrupt checkpoint, a kill in the middle of a save. Non-finite gradients fail the job
(`fault.on_nonfinite: raise`) so that it rolls back rather than skips, and the hang timeout is a
multiple of the uninterrupted run's step time, so the drill takes minutes, not hours. On a CPU in
the same layout the final losses and every tensor of the final checkpoint (weights, AdamW state,
RNG) must be bitwise equal.
"""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ferry.checkpoint import CheckpointError, list_checkpoints, verify_checkpoint
from ferry.config import UserError
from ferry.config.loader import validate
from ferry.metrics.jsonl import read_metrics
from ferry.portability.environment import Environment
from ferry.portability.legs import run_leg
from ferry.train.config import RunConfig, load_run_config

FAULT_KINDS = ("kill", "hang", "raise", "nan", "corrupt_checkpoint", "kill_during_save")
_CHECKPOINT_KINDS = ("corrupt_checkpoint", "kill_during_save")


@dataclass
class DrillResult:
    passed: bool
    record: dict
    lines: list[str] = field(default_factory=list)


def draw_faults(seed: int, count: int, steps: int, nproc: int, interval: int) -> list[dict]:
    """`count` faults at exponentially distributed steps (mean gap steps / (count + 1)), kinds and ranks uniform.

    Steps are at least 2, so a fault never strikes before the job has run. Checkpoint faults fall on
    a checkpoint step before the last (a corrupt last checkpoint is one no restart ever reads);
    a corrupt checkpoint never on the first (the drill would then have nothing valid to fall back
    to, a lesson about `checkpoint.keep`, not about recovery). Two faults never share a step and a
    kind: a colliding draw takes the next free step.
    """
    rng = random.Random(seed)
    mean_gap = steps / (count + 1)
    at = 0.0
    taken: set[tuple[int, str]] = set()
    faults: list[dict] = []
    for _ in range(count):
        at += rng.expovariate(1.0 / mean_gap)
        kind = rng.choice(FAULT_KINDS)
        rank = rng.randrange(nproc)
        step = _free_step(kind, min(max(2, round(at)), steps), steps, interval, taken)
        if step is None:
            kind = "raise"
            step = _free_step(kind, min(max(2, round(at)), steps), steps, interval, taken)
        taken.add((step, kind))
        faults.append({"step": step, "rank": rank, "kind": kind})
    return sorted(faults, key=lambda fault: fault["step"])


def _free_step(kind: str, wanted: int, steps: int, interval: int, taken: set) -> int | None:
    """The first step from `wanted` on (wrapping round) where a fault of `kind` may fall and none does yet."""
    if kind in _CHECKPOINT_KINDS:
        first = 2 * interval if kind == "corrupt_checkpoint" else interval
        candidates = list(range(first, steps, interval))
    else:
        candidates = list(range(2, steps + 1))
    if not candidates:
        return None
    start = min(range(len(candidates)), key=lambda index: abs(candidates[index] - wanted))
    for offset in range(len(candidates)):
        step = candidates[(start + offset) % len(candidates)]
        if (step, kind) not in taken:
            return step
    return None


def run_drill(
    config_path: str | Path,
    overrides: list[str],
    *,
    nproc: int,
    faults: int,
    seed: int,
    max_restarts: int | None = None,
    work_dir: str | Path | None = None,
    say: Callable[[str], None] = print,
) -> DrillResult:
    if nproc < 1 or faults < 0:
        raise UserError(f"ferry drill needs --nproc >= 1 and --faults >= 0 (got {nproc} and {faults})")
    if max_restarts is not None and max_restarts < 0:
        raise UserError(f"--max-restarts must be 0 or more, got {max_restarts}")
    base = load_run_config(config_path, list(overrides))
    steps = base.train.steps
    if faults > steps - 1:
        raise UserError(f"--faults {faults}: a run of {steps} steps has room for {steps - 1} faults (from step 2 on)")
    interval = base.checkpoint.interval if isinstance(base.checkpoint.interval, int) and base.checkpoint.interval else 0
    interval = interval or max(1, steps // 10)
    work = Path(work_dir) if work_dir is not None else Path("runs") / "drills" / f"{base.run.name}-seed{seed}"
    if work.exists() and any(work.iterdir()):
        raise UserError(f"drill directory {str(work)!r} is not empty; choose another --dir")
    layout = Environment(name="drill", nproc=nproc)
    raw = base.model_dump(mode="json")
    common = {"overwrite": True}
    saving = {"interval": interval, "keep": steps // interval + 2, "enabled": True}

    reference = _config(raw, work / "reference", saving, common, fault={"inject": []})
    say(f"ferry: drill: {steps} steps on {nproc} rank(s), checkpoint every {interval}; the uninterrupted run first")
    straight = run_leg("uninterrupted", layout, reference, work, say, steps=steps)
    if not straight.ok:
        raise UserError(f"the uninterrupted run failed, so there is nothing to drill against:\n    {straight.failure()}")
    step_s = statistics.median(record["step_s"] for record in read_metrics(straight.run_dir)[1:] or [{"step_s": 1}])
    schedule = draw_faults(seed, faults, steps, nproc, interval)
    hang_timeout = max(5.0, 20 * step_s)
    fault = {"inject": schedule, "on_nonfinite": "raise", "hang_timeout_s": hang_timeout, "hang_first_step_s": 10.0}
    drilled_config = _config(raw, work / "drilled", saving, common, fault=fault)
    budget = faults + 2 if max_restarts is None else max_restarts
    say("ferry: drill: faults " + ", ".join(f"{f['kind']} on rank {f['rank']} at step {f['step']}" for f in schedule))
    drilled = run_leg("drilled", layout, drilled_config, work, say, steps=steps,
                      options=["--max-restarts", str(budget)])
    record = _judge(straight.run_dir, drilled.run_dir, drilled.ok)
    run = drilled.record
    record.update({
        "seed": seed,
        "nproc": nproc,
        "steps": steps,
        "checkpoint_interval": interval,
        "hang_timeout_s": hang_timeout,
        "faults": schedule,
        "max_restarts": budget,
        "restarts": run.get("restarts", []),
        "goodput": run.get("goodput"),
        "uninterrupted_wall_s": straight.wall_s,
        "drilled_wall_s": drilled.wall_s,
        "dir": str(work),
    })
    (work / "drill.json").write_text(json.dumps(record, indent=1, default=str) + "\n", encoding="utf-8")
    lines = summary_lines(record) + [f"  details in {work / 'drill.json'}"]
    for line in lines:
        say(line)
    return DrillResult(record["passed"], record, lines)


def _config(raw: dict, run_dir: Path, saving: dict, run: dict, fault: dict) -> RunConfig:
    merged = json.loads(json.dumps(raw))
    merged["run"].update(run, dir=str(run_dir))
    merged["resume"] = None
    merged["checkpoint"].update(saving)
    merged["fault"].update(fault)
    return validate(RunConfig, merged)


def _judge(reference: Path, drilled: Path, finished: bool) -> dict:
    """Bitwise: the losses of every step, and every tensor of the final checkpoint."""
    if not finished:
        return {"passed": False, "failure": "the supervised run did not finish (its restart budget ran out)"}
    losses_a = [record["loss"] for record in read_metrics(reference)]
    losses_b = [record["loss"] for record in read_metrics(drilled)]
    differing_steps = [index + 1 for index, (a, b) in enumerate(zip(losses_a, losses_b)) if a != b]
    if len(losses_a) != len(losses_b):
        differing_steps.append(min(len(losses_a), len(losses_b)) + 1)
    final_a = list_checkpoints(reference / "checkpoints")[-1]
    final_b = list_checkpoints(drilled / "checkpoints")[-1]
    differing_tensors = []
    try:
        with verify_checkpoint(final_a) as a, verify_checkpoint(final_b) as b:
            names = sorted(set(a.names()) | set(b.names()))
            for name in names:
                if name not in a.names() or name not in b.names() or not torch.equal(a.read(name), b.read(name)):
                    differing_tensors.append(name)
    except CheckpointError as exc:
        return {"passed": False, "failure": f"a final checkpoint does not verify: {exc}"}
    return {
        "passed": not differing_steps and not differing_tensors,
        "losses_compared": min(len(losses_a), len(losses_b)),
        "differing_steps": differing_steps,
        "tensors_compared": len(names),
        "differing_tensors": differing_tensors,
        "final_checkpoints": [str(final_a), str(final_b)],
    }


def summary_lines(record: dict) -> list[str]:
    verdict = "PASS" if record["passed"] else "FAIL"
    lines = [f"ferry: drill {verdict}: {len(record['faults'])} fault(s), {len(record['restarts'])} restart(s)"]
    if "failure" in record:
        lines.append(f"  {record['failure']}")
    else:
        lines.append(
            f"  final state {'bitwise equal' if record['passed'] else 'DIFFERENT'}: {record['losses_compared']} losses "
            f"and {record['tensors_compared']} checkpoint tensors compared"
            + (f"; steps differing {record['differing_steps'][:5]}" if record["differing_steps"] else "")
            + (f"; tensors differing {record['differing_tensors'][:3]}" if record["differing_tensors"] else "")
        )
    for restart in record["restarts"]:
        latency = restart["restart_latency_s"]
        lines.append(
            f"  restart after step {restart['failed_at_step']}: resumed from step {restart['resumed_from_step']}, "
            f"{restart['steps_lost']} step(s) lost, back in {latency:.1f} s — {restart['cause']}"
            if latency is not None
            else f"  restart after step {restart['failed_at_step']}: {restart['cause']}"
        )
    good = record.get("goodput")
    if good:
        lines.append(
            f"  goodput {good['goodput']:.1%}: {good['productive_s']:.1f} s of steps in {good['wall_s']:.1f} s "
            f"(restarting {good['restarting_s']:.1f} s, saving {good['saving_s']:.2f} s, loading "
            f"{good['loading_s']:.2f} s, {good['lost_steps']} step(s) lost); uninterrupted run "
            f"{record['uninterrupted_wall_s']:.1f} s"
        )
    return lines
