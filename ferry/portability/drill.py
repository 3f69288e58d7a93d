"""`ferry drill`: a failure drill. The same job twice, once uninterrupted and once under supervision
with faults injected on a random schedule; the drill passes when the supervised job ends in exactly
the state of the uninterrupted one.

Faults arrive as failures do, at exponentially distributed intervals (a Poisson process, from
`--seed`), of a kind and on a rank drawn at random: kill, hang, raise, poisoned gradients, a
corrupt checkpoint, a kill in the middle of a save (of one rank or of all of them: multi-rank jobs save
in the background, so it strikes while their writer threads run). Non-finite gradients fail the job
(`fault.on_nonfinite: raise`) so that it rolls back rather than skips, and the hang timeout is a
multiple of the uninterrupted run's step time, so the drill takes minutes, not hours. On a CPU in
the same layout the final losses and every tensor of the final checkpoint (weights, optimizer state,
RNG) must be bitwise equal.

Equal end states prove only that the faults which struck were survived, so each fault is judged
from the job's own records (the fault markers and the restart event log) as exercised or not, and
the summary counts only the exercised ones: a corrupt checkpoint that no restart read was never
refused, and it is reported as such, not as survived.
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
from ferry.checkpoint.format import staging_dir_name, step_dir_name
from ferry.config import UserError
from ferry.config.loader import validate
from ferry.metrics.jsonl import read_metrics
from ferry.portability.comparison.environment import Environment
from ferry.portability.rehearsal.legs import run_leg
from ferry.train.config import RunConfig, load_run_config
from ferry.train.resilience.faults import fired_faults
from ferry.train.resilience.restarts import read_events, restarts_after

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

    A corrupt checkpoint is read only by a restart while it is the newest one: unless a drawn fault
    fails the job after its save and before the next, it is `followed_by` a `raise` on its rank at
    the next step, so that the restart finds it, refuses it and falls back to the one before.

    On several ranks a kill during a save strikes one rank or, as often, every rank (`rank: "all"`): with
    asynchronous saves each from its writer thread while training goes on, so that nothing of the save survives
    anywhere and the whole job restarts from the newest complete checkpoint.
    """
    rng = random.Random(seed)
    mean_gap = steps / (count + 1)
    at = 0.0
    taken: set[tuple[int, str]] = set()
    faults: list[dict] = []
    for _ in range(count):
        at += rng.expovariate(1.0 / mean_gap)
        kind = rng.choice(FAULT_KINDS)
        rank: int | str = rng.randrange(nproc)
        if kind == "kill_during_save" and nproc > 1 and rng.random() < 0.5:
            rank = "all"
        step = _free_step(kind, min(max(2, round(at)), steps), steps, interval, taken)
        if step is None:
            kind, rank = "raise", rank if rank != "all" else 0
            step = _free_step(kind, min(max(2, round(at)), steps), steps, interval, taken)
        taken.add((step, kind))
        faults.append({"step": step, "rank": rank, "kind": kind})
    faults.sort(key=lambda fault: fault["step"])
    for fault in faults:
        if fault["kind"] == "corrupt_checkpoint":
            newest_until = min(fault["step"] + interval, steps)
            if not any(
                other["kind"] != "corrupt_checkpoint" and fault["step"] < other["step"] <= newest_until
                for other in faults
            ):
                fault["followed_by"] = {"step": fault["step"] + 1, "rank": fault["rank"], "kind": "raise"}
    return faults


def injections(schedule: list[dict], nproc: int) -> list[dict]:
    """`fault.inject` for a drawn schedule on `nproc` ranks: its faults in order (fault `i` of the schedule is
    `fault.inject.i`, on rank 0 for one that strikes every rank), then the failures that follow corrupt checkpoints,
    then the same fault on every other rank for those that strike them all."""
    drawn = [{**{key: fault[key] for key in ("step", "kind")}, "rank": _first_rank(fault)} for fault in schedule]
    follow_ups = [fault["followed_by"] for fault in schedule if "followed_by" in fault]
    others = [
        {"step": fault["step"], "rank": rank, "kind": fault["kind"]}
        for fault in schedule
        if fault["rank"] == "all"
        for rank in range(1, nproc)
    ]
    return drawn + follow_ups + others


def _first_rank(fault: dict) -> int:
    return 0 if fault["rank"] == "all" else fault["rank"]


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
        raise UserError(
            f"the uninterrupted run failed, so there is nothing to drill against:\n    {straight.failure()}"
        )
    step_s = statistics.median(record["step_s"] for record in read_metrics(straight.run_dir)[1:] or [{"step_s": 1}])
    schedule = draw_faults(seed, faults, steps, nproc, interval)
    inject = injections(schedule, nproc)
    hang_timeout = max(5.0, 20 * step_s)
    fault = {"inject": inject, "on_nonfinite": "raise", "hang_timeout_s": hang_timeout, "hang_first_step_s": 10.0}
    drilled_config = _config(raw, work / "drilled", saving, common, fault=fault)
    budget = len(inject) + 2 if max_restarts is None else max_restarts
    say("ferry: drill: faults " + ", ".join(_fault_name(f) for f in schedule))
    drilled = run_leg(
        "drilled", layout, drilled_config, work, say, steps=steps, options=["--max-restarts", str(budget)]
    )
    record = _judge(straight.run_dir, drilled.run_dir, drilled.ok)
    run = drilled.record
    judged = fault_outcomes(drilled.run_dir, schedule)
    record.update(
        {
            "seed": seed,
            "nproc": nproc,
            "steps": steps,
            "checkpoint_interval": interval,
            "hang_timeout_s": hang_timeout,
            "faults": judged,
            "faults_exercised": sum(fault["exercised"] for fault in judged),
            "max_restarts": budget,
            "restarts": run.get("restarts", []),
            "goodput": run.get("goodput"),
            "uninterrupted_wall_s": straight.wall_s,
            "drilled_wall_s": drilled.wall_s,
            "dir": str(work),
        }
    )
    (work / "drill.json").write_text(json.dumps(record, indent=1, default=str) + "\n", encoding="utf-8")
    lines = summary_lines(record) + [f"  details in {work / 'drill.json'}"]
    for line in lines:
        say(line)
    return DrillResult(record["passed"], record, lines)


def _fault_name(fault: dict) -> str:
    then = fault.get("followed_by")
    where = "every rank" if fault["rank"] == "all" else f"rank {fault['rank']}"
    return f"{fault['kind']} on {where} at step {fault['step']}" + (
        f" (then {then['kind']} at step {then['step']}, so that a restart reads it)" if then else ""
    )


def fault_outcomes(run_dir: Path, schedule: list[dict]) -> list[dict]:
    """Each fault of `schedule` (fault `i` is `fault.inject.i` of the run in `run_dir`) with `exercised` and
    `outcome`: what the job's records show it led to, or why it was not exercised.

    A failure (kill, hang, raise, poisoned gradients) is exercised when it fired and a restart restored the
    job after the failure it caused; a kill during a save, when a restart after it removed the unfinished
    save (which no reader lists, so the restart went on from an older checkpoint); a corrupt checkpoint,
    when a restart after it tried that checkpoint, refused it (it is among the restart's skipped
    checkpoints) and resumed from an older one.
    """
    fired = fired_faults(run_dir)
    events = read_events(run_dir)
    judged = []
    for index, fault in enumerate(schedule):
        at = fired.get(index)
        exercised, outcome = (False, "it never fired") if at is None else _outcome(fault, restarts_after(events, at))
        judged.append({**fault, "exercised": exercised, "outcome": outcome})
    return judged


def _outcome(fault: dict, after: list[dict]) -> tuple[bool, str]:
    """Whether the restarts that followed a fault's firing (`after`) show it exercised, and how or why not."""
    kind, step = fault["kind"], fault["step"]
    restored = [row for row in after if row["resumed_from_step"] is not None]
    if kind == "corrupt_checkpoint":
        name = step_dir_name(step)
        reader = _first_naming(restored, "skipped_checkpoints", name)
        if reader is not None:
            return True, (
                f"the restart after step {reader['failed_at_step']} refused {name} "
                f"and resumed from step {reader['resumed_from_step']}"
            )
        if not restored:
            return False, f"no restart followed it, so nothing read {name}"
        first = restored[0]
        return False, (
            f"no restart read {name}: the first after it (after step {first['failed_at_step']}) "
            f"resumed from the newer step {first['resumed_from_step']}"
        )
    if kind == "kill_during_save":
        partial = staging_dir_name(step)
        remover = _first_naming(restored, "removed_unfinished_saves", partial)
        if remover is None:
            return False, f"no restart found its unfinished save {partial}"
        return True, (
            f"the save was cut short; the restart after step {remover['failed_at_step']} removed {partial} "
            f"and resumed from step {remover['resumed_from_step']}"
        )
    if not restored:
        return False, "no restart restored the job after it"
    failed, resumed = after[0]["failed_at_step"], restored[0]["resumed_from_step"]
    return True, f"the job failed after step {failed} and resumed from step {resumed}"


def _first_naming(rows: list[dict], key: str, name: str) -> dict | None:
    """The first restart of `rows` whose list of paths under `key` holds one called `name`."""
    return next((row for row in rows if name in {Path(path).name for path in row[key]}), None)


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
    """The verdict counts only the faults exercised; any other is named as not exercised, with why."""
    verdict = "PASS" if record["passed"] else "FAIL"
    exercised = sum(fault["exercised"] for fault in record["faults"])
    missed = len(record["faults"]) - exercised
    lines = [
        f"ferry: drill {verdict}: {exercised} fault(s) exercised, {len(record['restarts'])} restart(s)"
        + (f"; {missed} fault(s) NOT exercised, not counted" if missed else "")
    ]
    if "failure" in record:
        lines.append(f"  {record['failure']}")
    else:
        lines.append(
            f"  final state {'bitwise equal' if record['passed'] else 'DIFFERENT'}: {record['losses_compared']} losses "
            f"and {record['tensors_compared']} checkpoint tensors compared"
            + (f"; steps differing {record['differing_steps'][:5]}" if record["differing_steps"] else "")
            + (f"; tensors differing {record['differing_tensors'][:3]}" if record["differing_tensors"] else "")
        )
    for fault in record["faults"]:
        lines.append(
            f"  {_fault_name(fault)}: {'exercised' if fault['exercised'] else 'NOT exercised'} — {fault['outcome']}"
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
