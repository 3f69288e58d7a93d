"""`ferry rehearse`: prove that a run moves from one environment to another and keeps training the same.

The drill, on one machine or split over two (`start` on the source, `finish` on the target):

  source      train from scratch to `steps`, checkpointing at `switch_at` in the source's own
              sharding; its uninterrupted trajectory is the reference
  bundle      the switch checkpoint, the reference trajectory, the resolved config, the source
              environment and the digests of all of it
  target      resume the switch checkpoint (weights, optimizer moments, schedule, loss scaler,
              RNG, data cursor) and continue to `steps`; then train from scratch to `switch_at`
  judge       the resumed target against the reference after the switch, and the target from
              scratch against the reference before it (same seed, same data), both under one
              tolerance profile chosen before anything runs

An objective that draws its own training data (GRPO) is judged under `sampled`, against the
spread between seeds: the source also trains the config with other seeds (`seeds` of that
profile, as many steps as the reference), and the bundle carries their trajectories.

The verdict is PASS only when both comparisons pass; it is appended to the rehearsal
history with the switching lead time, whatever it says.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ferry.config import UserError, apply_overrides
from ferry.config.loader import validate
from ferry.platform.fingerprint import code_version
from ferry.portability.comparison.compare import Verdict, compare_runs, measured_spread
from ferry.portability.comparison.environment import Environment, judging_profile, load_environment, without_locations
from ferry.portability.comparison.tolerances import SAMPLED_PROFILE, tolerance_profile
from ferry.portability.rehearsal.bundle import Bundle, check_compatible, config_digest, read_bundle, write_bundle
from ferry.portability.rehearsal.legs import LegResult, run_leg
from ferry.portability.rehearsal.record import (
    comparison_record,
    portable_on_target,
    summary_lines,
    worst_comparison,
)
from ferry.portability.report.history import HISTORY_DIR, REHEARSALS, append_record
from ferry.train.config import RunConfig, load_run_config
from ferry.train.objectives.kinds import SAMPLING_OBJECTIVES
from ferry.train.run_dir.record import CONFIG_NAME

Say = Callable[[str], None]


@dataclass
class Rehearsal:
    """The outcome of one rehearsal: what `ferry rehearse` prints and the history keeps."""

    passed: bool
    record: dict[str, Any]
    lines: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1


def rehearse(
    config_path: str | Path,
    overrides: list[str],
    source_spec: str,
    target_spec: str,
    *,
    steps: int | None = None,
    switch_at: int | None = None,
    work_dir: str | Path | None = None,
    profile: str | None = None,
    history_dir: str | Path = HISTORY_DIR,
    say: Say = print,
) -> Rehearsal:
    """The whole drill on this machine: `start` into `work_dir/bundle`, then `finish` from it."""
    source, target = load_environment(source_spec), load_environment(target_spec)
    base, steps, switch_at = _base_config(config_path, overrides, steps, switch_at)
    work = _work_dir(work_dir, base, source, target)
    for leg in _leg_overrides(work, steps, switch_at, resume="checkpoint").values():
        target.run_config(base, leg)  # the target's configs are checked before the source trains
    samples = base["train"]["objective"] in SAMPLING_OBJECTIVES
    if profile is not None and tolerance_profile(profile).seeds and not samples:
        raise UserError(
            f"profile {profile} judges against the spread between seeds, which the source measures only for an "
            f"objective that samples its data ({', '.join(sorted(SAMPLING_OBJECTIVES))}), not "
            f"{base['train']['objective']}; choose another --profile"
        )
    seed_runs = profile is None or tolerance_profile(profile).seeds > 0
    bundle = _start(base, source, steps, switch_at, work, work / "bundle", say, seed_runs=seed_runs)
    started = time.time()
    return _finish(read_bundle(bundle.path), target, [], work, profile, history_dir, say, started)


def start(
    config_path: str | Path,
    overrides: list[str],
    source_spec: str,
    out: str | Path,
    *,
    steps: int | None = None,
    switch_at: int | None = None,
    work_dir: str | Path | None = None,
    say: Say = print,
) -> Bundle:
    """The source half: train on the source, write the bundle to `out` for the target half to finish."""
    source = load_environment(source_spec)
    base, steps, switch_at = _base_config(config_path, overrides, steps, switch_at)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"bundle directory {str(out)!r} is not empty; choose another --out")
    work = Path(work_dir) if work_dir is not None else out.with_name(f"{out.name}-source")
    _check_empty(work)
    return _start(base, source, steps, switch_at, work, out, say)


def finish(
    bundle_path: str | Path,
    target_spec: str,
    overrides: list[str] = (),
    *,
    work_dir: str | Path | None = None,
    profile: str | None = None,
    history_dir: str | Path = HISTORY_DIR,
    say: Say = print,
) -> Rehearsal:
    """The target half: check the bundle, resume it on the target, train the target from scratch, judge."""
    started = time.time()
    bundle = read_bundle(bundle_path)
    target = load_environment(target_spec)
    if profile is not None:
        tolerance_profile(profile)
    work = Path(work_dir) if work_dir is not None else Path(f"{Path(bundle_path)}-{target.name}")
    _check_empty(work)
    return _finish(bundle, target, list(overrides), work, profile, history_dir, say, started)


def _base_config(
    config_path: str | Path, overrides: list[str], steps: int | None, switch_at: int | None
) -> tuple[dict, int, int]:
    config = load_run_config(config_path, list(overrides))
    if config.run.init_device != "host":
        raise UserError(
            f"run.init_device is {config.run.init_device}: the weights would be drawn by each environment's own "
            "device, and the target's run from scratch would not start where the source's did; use host"
        )
    steps = config.train.steps if steps is None else steps
    switch_at = steps // 2 if switch_at is None else switch_at
    if steps < 2:
        raise UserError(f"--steps must be at least 2 (a step before the switch and one after), got {steps}")
    if not 1 <= switch_at < steps:
        raise UserError(f"--switch-at must lie in [1, {steps - 1}] for --steps {steps}, got {switch_at}")
    return config.model_dump(mode="json"), steps, switch_at


def _work_dir(work_dir: str | Path | None, base: dict, source: Environment, target: Environment) -> Path:
    if work_dir is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        work_dir = Path("runs") / "rehearsals" / f"{base['run']['name']}-{source.name}-to-{target.name}-{stamp}"
    work = Path(work_dir)
    _check_empty(work)
    return work


def _check_empty(work: Path) -> None:
    if work.exists() and any(work.iterdir()):
        raise UserError(f"rehearsal directory {str(work)!r} is not empty; choose another --dir")


def _leg_overrides(work: Path, steps: int, switch_at: int, resume: str) -> dict[str, dict]:
    """What each leg sets over the environment: where it writes, how far it trains, what it saves."""
    common = {"run.overwrite": True, "train.steps": steps, "checkpoint.dir": None}
    return {
        "source": {
            **common,
            "run.dir": str(work / "source"),
            "resume": None,
            "train.stop_at": None,
            "checkpoint.interval": switch_at,
            "checkpoint.keep": steps // switch_at + 1,
        },
        "target-resumed": {
            **common,
            "run.dir": str(work / "target-resumed"),
            "resume": resume,
            "train.stop_at": None,
            "checkpoint.interval": 0,
        },
        "target-scratch": {
            **common,
            "run.dir": str(work / "target-scratch"),
            "resume": None,
            "train.stop_at": switch_at,
            "checkpoint.interval": 0,
        },
    }


def _seed_leg_overrides(work: Path, steps: int, seed: int) -> dict:
    """A seed run of the source: the reference's config and steps with another seed, no checkpoint."""
    return {
        "run.overwrite": True,
        "train.steps": steps,
        "checkpoint.dir": None,
        "run.dir": str(work / f"source-seed-{seed}"),
        "run.seed": seed,
        "resume": None,
        "train.stop_at": None,
        "checkpoint.interval": 0,
        "checkpoint.enabled": False,
    }


def _seed_runs(base: dict, source: Environment, steps: int, work: Path, say: Say) -> dict[int, LegResult]:
    """For an objective that samples its data: the source's runs with the next seeds, which measure how far
    runs part by their draws alone (the `sampled` profile's band)."""
    if base["train"]["objective"] not in SAMPLING_OBJECTIVES:
        return {}
    count = tolerance_profile(SAMPLED_PROFILE).seeds
    say(
        f"ferry: rehearse: objective {base['train']['objective']} samples its training data: {count} seed run(s) "
        "on the source measure the spread it is judged against"
    )
    legs = {}
    for seed in range(base["run"]["seed"] + 1, base["run"]["seed"] + 1 + count):
        config = source.run_config(base, _seed_leg_overrides(work, steps, seed))
        leg = run_leg(f"source-seed-{seed}", source, config, work, say, steps=steps)
        if not leg.ok:
            raise RehearsalError(f"the source's seed run {seed} on {source.label} failed:\n    {leg.failure()}")
        legs[seed] = leg
    return legs


def _start(
    base: dict, source: Environment, steps: int, switch_at: int, work: Path, out: Path, say: Say, seed_runs: bool = True
) -> Bundle:
    """The source half; `seed_runs` False skips the seed runs when the judging profile is known not to need them."""
    config = source.run_config(base, _leg_overrides(work, steps, switch_at, resume="")["source"])
    say(f"ferry: rehearse: source {source.name}: {steps} steps from scratch, switch checkpoint at step {switch_at}")
    leg = run_leg("source", source, config, work, say, steps=steps)
    if not leg.ok:
        raise RehearsalError(
            f"the source run on {source.label} failed, so there is nothing to move:\n    {leg.failure()}"
        )
    checkpoint = config.checkpoint.path(config.run.path) / f"step-{switch_at:08d}"
    if not checkpoint.is_dir():
        raise RehearsalError(f"the source run finished without its switch checkpoint {checkpoint}")
    seed_legs = _seed_runs(base, source, steps, work, say) if seed_runs else {}
    bundle = write_bundle(
        out,
        config_name=base["run"]["name"],
        base_config=base,
        source=source,
        steps=steps,
        switch_at=switch_at,
        source_leg=leg,
        checkpoint=checkpoint,
        seed_legs=seed_legs,
    )
    seeds = f", {len(seed_legs)} seed run(s)" if seed_legs else ""
    say(
        f"ferry: rehearse: bundle written to {bundle.path} (switch checkpoint step {switch_at}, reference "
        f"trajectory{seeds})"
    )
    return bundle


def _finish(
    bundle: Bundle,
    target: Environment,
    overrides: list[str],
    work: Path,
    profile: str | None,
    history_dir: str | Path,
    say: Say,
    started: float | None = None,
) -> Rehearsal:
    started = time.time() if started is None else started
    source = bundle.source()
    base = apply_overrides(bundle.base_config, overrides)
    legs = _leg_overrides(work, bundle.steps, bundle.switch_at, resume=str(bundle.checkpoint.resolve()))
    resumed_config = target.run_config(base, legs["target-resumed"])
    scratch_config = target.run_config(base, legs["target-scratch"])
    _check_reference(bundle, source, legs["source"])
    _check_seed_runs(bundle, source)
    check_compatible(bundle, resumed_config)
    chosen, reason = judging_profile(
        source.run_config(bundle.base_config), source.nproc, target.run_config(base), target.nproc
    )
    if profile is not None:
        chosen, reason = profile, f"given with --profile (ferry would have chosen {chosen}: {reason})"
    tolerance = tolerance_profile(chosen)
    if len(bundle.seed_runs) < tolerance.seeds:
        raise UserError(
            f"profile {chosen} judges against the spread between seeds, and bundle {str(bundle.path)!r} carries "
            f"{len(bundle.seed_runs)} seed run(s) of the {tolerance.seeds} it needs (the source trains them for "
            "objectives that sample their data); choose another --profile"
        )
    if tolerance.seeds:
        steps = list(range(1, bundle.steps + 1))
        measured_spread(bundle.reference, bundle.seed_runs, tolerance.metric, steps, tolerance.window)
    conclusive = bundle.switch_at >= tolerance.min_steps
    checked = time.time()
    say(f"ferry: rehearse: {source.name} -> {target.name}, judged under {chosen} ({reason})")

    resumed = run_leg("target-resumed", target, resumed_config, work, say, steps=bundle.steps - bundle.switch_at)
    comparisons: dict[str, Verdict | str] = {}
    comparisons["resumed"] = _judge(bundle, resumed, chosen, bundle.steps, work / "compare-resumed")
    judged = time.time()
    scratch = run_leg("target-scratch", target, scratch_config, work, say, steps=bundle.switch_at)
    comparisons["scratch"] = _judge(bundle, scratch, chosen, bundle.switch_at, work / "compare-scratch")

    passed = all(isinstance(verdict, Verdict) and verdict.passed for verdict in comparisons.values())
    reference = bundle.reference_record()
    resumed_from = resumed.record.get("resumed_from") or {}
    source_leg = bundle.content.get("source_leg", {})
    source_tps = source_leg.get("tokens_per_s")
    target_tps = resumed.median_tokens_per_s()
    record = {
        "kind": "rehearsal",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "path": f"{source.name} -> {target.name}",
        "source": bundle.content["source"]["definition"] | {"digest": source.digest},
        "target": target.as_record(),
        "config": {"name": bundle.content["config"]["name"], "digest": config_digest(base)},
        "steps": bundle.steps,
        "switch_at": bundle.switch_at,
        "finish_overrides": list(overrides),
        "profile": chosen,
        "profile_reason": reason,
        "tolerance": tolerance.model_dump(),
        "verdict": "PASS" if passed else "FAIL",
        "passed": passed,
        "conclusive": conclusive,
        "inconclusive_reason": None
        if conclusive
        else (
            f"the from-scratch window of {bundle.switch_at} steps is shorter than the {tolerance.min_steps} that "
            f"{chosen} needs to tell a real change from drift (ferry/portability/tolerances.yaml)"
        ),
        "comparisons": {name: comparison_record(verdict) for name, verdict in comparisons.items()},
        "worst": worst_comparison(comparisons),
        "carried": resumed_from.get("carried", {}),
        "lead_time": {
            "bundle_check_s": checked - started,
            "verify_s": resumed_from.get("verify_s"),
            "restore_s": resumed_from.get("restore_s"),
            "first_step_s": None
            if resumed.record.get("first_step_at_unix") is None
            else resumed.record["first_step_at_unix"] - started,
            "judged_s": judged - started,
        },
        "throughput": {
            "source_tokens_per_s": source_tps,
            "target_tokens_per_s": target_tps,
            "target_over_source": target_tps / source_tps if source_tps and target_tps else None,
            "source_conditions": source_leg.get("conditions"),
            "target_conditions": resumed.conditions(),
        },
        "portable_on_target": portable_on_target(reference.get("kernels", {}).get("ops", {}), resumed.kernels()),
        "fingerprints": {"source": reference.get("environment"), "target": resumed.record.get("environment")},
        "ferry": {"source": bundle.content.get("ferry"), "target": code_version()},
        "bundle": str(bundle.path),
        "dir": str(work),
    }
    history = append_record(history_dir, REHEARSALS, record)
    (work / "verdict.json").write_text(_json(record), encoding="utf-8")
    lines = summary_lines(record) + [f"  recorded in {history}; details in {work / 'verdict.json'}"]
    for line in lines:
        say(line)
    return Rehearsal(passed, record, lines)


def _check_reference(bundle: Bundle, source: Environment, source_leg: dict) -> None:
    """The bundle's config and source environment must be what the source actually ran: its reference
    config (a digest-checked file) must equal them laid over each other, wherever the runs were written."""
    differing = _recorded_differences(source.run_config(bundle.base_config, source_leg), bundle.reference)
    if differing:
        raise UserError(
            f"bundle {str(bundle.path)!r} was tampered with: its bundle.json does not describe the run its reference "
            f"config records (they differ in {', '.join(differing)})"
        )


def _check_seed_runs(bundle: Bundle, source: Environment) -> None:
    """Each seed run the bundle carries must be the source's config with its seed and nothing else changed: one
    trained otherwise (another learning rate, say) would widen the band it measures."""
    for run in bundle.seed_runs:
        seed = int(run.name.removeprefix("seed-"))
        expected = source.run_config(bundle.base_config, _seed_leg_overrides(run, bundle.steps, seed))
        differing = _recorded_differences(expected, run)
        if differing:
            raise UserError(
                f"bundle {str(bundle.path)!r}: its seed run {run.name} is not the source's config with seed {seed} "
                f"(they differ in {', '.join(differing)})"
            )


def _recorded_differences(expected: RunConfig, run_dir: Path) -> list[str]:
    """The config sections in which the config a run recorded differs from `expected`, locations aside."""
    recorded = validate(RunConfig, yaml.safe_load((run_dir / CONFIG_NAME).read_text(encoding="utf-8")))
    ours = without_locations(expected.model_dump(mode="json"))
    theirs = without_locations(recorded.model_dump(mode="json"))
    return [key for key in ours if ours[key] != theirs.get(key)]


class RehearsalError(Exception):
    """The drill could not be carried out (a source that fails): no verdict, nothing recorded; exit code 1."""


def _judge(bundle: Bundle, leg: LegResult, profile: str, steps: int, output: Path) -> Verdict | str:
    """The leg's trajectory against the reference, or why there is none to judge."""
    if not leg.ok:
        return f"the {leg.name} run failed (exit code {leg.returncode}): {leg.failure()}"
    seed_runs = bundle.seed_runs if tolerance_profile(profile).seeds else []
    return compare_runs(
        bundle.reference, leg.run_dir, profile=profile, steps=steps, output_dir=output, seed_runs=seed_runs
    )


def _json(record: dict) -> str:
    return json.dumps(record, indent=1, default=str) + "\n"
