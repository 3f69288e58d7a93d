"""`ferry release replay DIR --stage NAME [--steps N] [--env ENV]`: a stage's first steps again, from the release.

The stage's resolved config is run with its parent checkpoint taken from the release (the previous stage's, by
the digest the lineage records), its data from the release (`ferry release --data`) or else from the paths its
config names, each matched to the manifest digest the release records; `train.stop_at` ends it after N steps,
so its schedule is the recorded one. The replayed curve is judged against the recorded metrics under the profile
`ferry rehearse` would choose for the move from the recorded environment to the replay's (`judging_profile`):
same-hardware when only layout, kernels or collectives differ, cross-accelerator otherwise.

A stage whose objective samples its own data (GRPO) is judged by `sampled`, on its reward against the spread
between runs that differ only in their seed: a release carries none, so the replay trains them first (the
recorded config with the next seeds, on this machine) and says so.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ferry.checkpoint.format import MANIFEST_NAME
from ferry.config import ConfigError, UserError, apply_override_mapping
from ferry.config.loader import dump_yaml, parse_override, validate
from ferry.data.manifest import sha256_file
from ferry.metrics.jsonl import read_metrics
from ferry.portability.comparison.compare import Verdict, compare_runs
from ferry.portability.comparison.environment import Environment, judging_profile, load_environment
from ferry.portability.comparison.tolerances import SAMPLED_PROFILE, tolerance_profile
from ferry.portability.rehearsal.legs import run_leg
from ferry.portability.release.verify import read_release, verify_release
from ferry.train.config import RunConfig

Say = Callable[[str], None]
_PLURALS = {"replay": "replays", "branch": "branches"}


@dataclass
class Replay:
    stage: str
    steps: int
    environment: str
    profile: str
    reason: str
    verdict: Verdict | None
    failure: str | None
    run_dir: Path
    seed_runs: list[Path] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.verdict is not None and self.verdict.passed

    def lines(self) -> list[str]:
        if self.verdict is None:
            return [f"ferry: replay of stage {self.stage}: FAIL under profile {self.profile} — {self.failure}"]
        outcome = "PASS" if self.verdict.passed else "FAIL"
        return [
            f"ferry: replay of stage {self.stage} ({self.steps} steps on {self.environment}): {outcome} under "
            f"profile {self.profile} ({self.reason})",
            f"  {self.verdict.summary()}",
        ]


def replay_stage(
    directory: str | Path,
    stage: str,
    steps: int | None = None,
    env: str | None = None,
    work: str | Path | None = None,
    say: Say = print,
    overrides: list[str] = (),
) -> Replay:
    """Replay `stage` of the release in `directory` (verified first) and judge it; bad input is a `UserError`.
    `overrides` (dotted `KEY=VALUE`) are laid over the environment's, and judged as part of it."""
    directory = Path(directory).resolve()
    release = read_release(directory)
    entry = released_stage(release, stage)
    if steps is not None and steps < 1:
        raise UserError(f"--steps must be at least 1, got {steps}")
    check_verified(directory, "a replay")
    name = f"{release['pipeline']['name']}-{stage}"
    work = Path(work) if work is not None else outside_release(directory, "replay", name)
    refuse_inside(directory, work, "--work")
    run_dir = work / "replay"
    base, procedure, count = stage_inputs(directory, release, entry, steps, run_dir)
    # the replay's own settings (where it starts, runs and stops) on both sides: only the environment differs
    recorded_config = _validated(base, procedure, f"stage {stage}'s config")
    environment = (
        load_environment(env)
        if env is not None
        else Environment(name="this machine (the recorded config)", nproc=entry.get("world_size") or 1)
    ).with_overrides(_parsed(overrides), "the command line's overrides")
    config = environment.run_config(base, procedure, by="the replay")
    profile, reason = judging_profile(recorded_config, entry.get("world_size") or 1, config, environment.nproc)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    say(f"ferry: replay of stage {stage}: {count} step(s) on {environment.name}, judged under {profile} ({reason})")
    seed_runs: list[Path] = []
    if tolerance_profile(profile).seeds:
        carried = carried_seed_runs(directory, entry, count, say)
        if carried is None:
            seed, count_seeds = int(base.get("run", {}).get("seed", 0)), tolerance_profile(SAMPLED_PROFILE).seeds
            say(
                f"ferry: replay of stage {stage}: objective {entry['objective']} samples its training data; the "
                f"release carries no seed runs, so {count_seeds} are trained here, or reused from --work (seeds "
                f"{seed + 1}..{seed + count_seeds}, the recorded config), to measure the spread profile "
                f"{SAMPLED_PROFILE} judges against"
            )
        seed_runs, failure = carried or train_seed_runs(base, procedure, entry, count, work, say)
        if failure is not None:
            return Replay(stage, count, environment.name, profile, reason, None, failure, run_dir)
    leg = run_leg("replay", environment, config, work, say, steps=count)
    if not leg.ok:
        return Replay(
            stage,
            count,
            environment.name,
            profile,
            reason,
            None,
            f"the replay failed (exit {leg.returncode}): {leg.failure()}",
            run_dir,
        )
    verdict = compare_runs(
        directory / entry["dir"],
        run_dir,
        profile=profile,
        steps=count,
        output_dir=work / "compare",
        seed_runs=seed_runs,
    )
    return Replay(stage, count, environment.name, profile, reason, verdict, None, run_dir, seed_runs)


def released_stage(release: dict[str, Any], stage: str) -> dict[str, Any]:
    stages = {entry["name"]: entry for entry in release["stages"]}
    if stage not in stages:
        raise UserError(f"--stage {stage!r}: the release's stages are {', '.join(stages)}")
    return stages[stage]


def check_verified(directory: Path, what: str) -> None:
    check = verify_release(directory)
    if not check.passed:
        raise UserError(
            f"release {directory} does not verify ({check.problems[0]}); {what} needs the release as released "
            "(ferry release verify names every problem)"
        )


def outside_release(directory: Path, kind: str, name: str) -> Path:
    """Where a replay or a branch (`kind`) works unless told: `runs/release-<kind>/NAME` here, or, when here is
    inside the release (its model card's commands run from there), `<release>-replays/NAME` (`-branches/`) beside
    it: nothing may be written into a release, whose every file `ferry release verify` checks."""
    work = Path("runs") / f"release-{kind}" / name
    if work.resolve().is_relative_to(directory):
        work = directory.parent / f"{directory.name}-{_PLURALS[kind]}" / name
    return work


def refuse_inside(directory: Path, path: Path, option: str) -> None:
    if path.resolve().is_relative_to(directory):
        raise UserError(
            f"{option} {path} lies inside the release {directory}, whose every file `ferry release verify` checks: "
            "choose a place outside it"
        )


def _parsed(overrides: list[str]) -> dict[str, Any]:
    try:
        return {".".join(keys): value for keys, value in map(parse_override, overrides)}
    except ConfigError as exc:
        raise UserError(str(exc)) from None


def stage_inputs(
    directory: Path, release: dict[str, Any], entry: dict[str, Any], steps: int | None, run_dir: Path
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """The stage's recorded config (as the recorded run resolved it) reading the release's data, the overrides
    that start it from the release and stop it after `steps` of its recorded steps (all by default) in `run_dir`,
    and how many steps that is."""
    stage = entry["name"]
    recorded = read_metrics(directory / entry["dir"])
    recorded_steps = sorted({record["step"] for record in recorded if isinstance(record.get("step"), int)})
    base = _as_recorded(read_config(directory / entry["config"]), directory / entry["dir"] / "run.json")
    base = released_data(directory, release, entry, base)
    total = base.get("train", {}).get("steps")
    first = min(recorded_steps) if recorded_steps else 1
    count = len(recorded_steps) if steps is None else min(steps, len(recorded_steps))
    overrides = _start(directory, release, entry, stage)
    stop_at = first - 1 + count
    overrides.update(
        {"run.dir": str(run_dir), "run.overwrite": True, "train.stop_at": stop_at if stop_at < total else None}
    )
    overrides["metrics.sinks.console"] = False
    return base, overrides, count


def carried_seed_runs(directory: Path, entry: dict[str, Any], steps: int, say: Say) -> tuple[list[Path], None] | None:
    """The seed runs the release carries for the stage (`ferry release --seed-runs`), when they cover `steps`."""
    count = tolerance_profile(SAMPLED_PROFILE).seeds
    runs = [directory / run for run in entry.get("seed_runs", [])][:count]
    if len(runs) < count or any(len(read_metrics(run)) < steps for run in runs):
        return None
    say(
        f"ferry: replay of stage {entry['name']}: judged against the {count} seed runs the release carries "
        f"({', '.join(run.name for run in runs)}: the recorded config with other seeds, trained by the releaser)"
    )
    return runs, None


def train_seed_runs(
    base: dict[str, Any], overrides: dict[str, Any], entry: dict[str, Any], steps: int, work: Path, say: Say
) -> tuple[list[Path], str | None]:
    """The runs of the stage's recorded config with the next seeds, which measure the spread a `sampled` verdict
    is judged against, trained here (on the recorded config) where the release carries none, and said so."""
    count = tolerance_profile(SAMPLED_PROFILE).seeds
    recorded = Environment(name="the recorded config", nproc=entry.get("world_size") or 1)
    seed = int(base.get("run", {}).get("seed", 0))
    runs = []
    for other in range(seed + 1, seed + 1 + count):
        run_dir = work / f"seed-{other}"
        config = recorded.run_config(base, {**overrides, "run.dir": str(run_dir), "run.seed": other})
        if _trained_earlier(config, work / "configs" / f"seed-{other}.yaml", steps):
            say(f"ferry: seed-{other}: trained earlier with this config in {run_dir}; reused")
            runs.append(run_dir)
            continue
        if run_dir.exists():
            shutil.rmtree(run_dir)
        leg = run_leg(f"seed-{other}", recorded, config, work, say, steps=steps)
        if not leg.ok:
            return runs, f"the seed run {other} failed (exit {leg.returncode}): {leg.failure()}"
        runs.append(run_dir)
    return runs, None


def _trained_earlier(config: RunConfig, config_path: Path, steps: int) -> bool:
    """A seed run of an earlier replay in the same --work with the same config and every step: kept (a replay
    of the same stage on another environment is judged against the same spread)."""
    try:
        same = config_path.read_text(encoding="utf-8") == dump_yaml(config)
        return same and len(read_metrics(config.run.path)) >= steps
    except (OSError, UserError):
        return False


def _as_recorded(base: dict[str, Any], run_record: Path) -> dict[str, Any]:
    """The config with what it left to `auto` (device, hardware profile, dtypes) set to what the recorded run
    resolved it to (its run.json): a replay without --env runs as recorded, and a move is judged from there."""
    try:
        record = json.loads(run_record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return base
    raw = copy.deepcopy(base)
    resolved = {
        ("run", "device"): (record.get("environment") or {}).get("device_type"),
        ("hardware",): (record.get("hardware") or {}).get("profile"),
        **{
            ("precision", key): (record.get("precision") or {}).get(key)
            for key in ("param_dtype", "compute_dtype", "reduce_dtype")
        },
    }
    for keys, value in resolved.items():
        section = raw
        for key in keys[:-1]:
            section = section.setdefault(key, {})
        if value is not None and section.get(keys[-1]) in (None, "auto"):
            section[keys[-1]] = value
    return raw


def read_config(path: Path) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"{path}: unreadable ({exc})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: not a run config")
    return raw


def _validated(base: dict[str, Any], overrides: dict[str, Any], origin: str) -> RunConfig:
    try:
        return validate(RunConfig, apply_override_mapping(copy.deepcopy(base), overrides, origin))
    except ConfigError as exc:
        raise UserError(f"{origin}: {exc}") from None


def _start(directory: Path, release: dict[str, Any], entry: dict[str, Any], stage: str) -> dict[str, Any]:
    """Where the stage starts: scratch, or its parent stage's checkpoint in the release."""
    parent = entry.get("parent")
    overrides: dict[str, Any] = {"init_from": None, "init_optimizer": False, "resume": None}
    if parent is None:
        return overrides
    stages = {other["name"]: other for other in release["stages"]}
    if parent.get("stage") not in stages:
        raise UserError(
            f"stage {stage} starts from {parent['checkpoint']}, which is no stage of this release: its parent is "
            "not in it to replay from"
        )
    checkpoint = stages[parent["stage"]]["checkpoint"]
    if checkpoint["lineage_digest"] != parent["digest"]:
        raise UserError(f"stage {stage}'s parent digest is not stage {parent['stage']}'s checkpoint in the release")
    path = str(directory / checkpoint["path"])
    start = entry["start"]
    needs_optimizer = start["carry"] == "weights+optimizer"
    if needs_optimizer and not checkpoint["optimizer"]:
        state = f"{checkpoint.get('optimizer_kind') or 'optimizer'} state"
        raise UserError(
            f"stage {stage} starts from {parent['stage']}'s weights and {state}, and this release carries no "
            "optimizer state: release the pipeline with --optimizer to replay it"
        )
    if start["steps"] == "continue":
        overrides["resume"] = path
    else:
        overrides.update({"init_from": path, "init_optimizer": needs_optimizer})
    return overrides


def released_data(
    directory: Path, release: dict[str, Any], entry: dict[str, Any], base: dict[str, Any]
) -> dict[str, Any]:
    """The stage's config reading each dataset from the release's copy, else from the path the config names,
    refused unless its manifest is the one the release records."""
    return apply_override_mapping(base, _data(directory, release, entry, base), f"stage {entry['name']}'s data")


def _data(directory: Path, release: dict[str, Any], entry: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Each dataset of the stage's config: the release's copy, else the path the config names, refused unless its
    manifest is the one the release records."""
    sources = {source["key"]: source for source in release["data"]}
    overrides: dict[str, Any] = {}
    for section, uses in (("data", entry["data"]), ("eval", entry["eval_data"])):
        configured = copy.deepcopy(base.get(section, {}).get("sources", []))
        for source in configured:
            use = next((use for use in uses if use["name"] == source["name"]), None)
            released = sources.get(use["source"]) if use is not None else None
            if released is None:
                raise UserError(f"stage {entry['name']}: {section} source {source['name']} is not in the release")
            path = directory / released["dir"] if released["files_included"] else Path(source["path"])
            manifest = path / MANIFEST_NAME
            if not manifest.is_file():
                raise UserError(
                    f"stage {entry['name']}: data source {source['name']} is not at {path} (the release carries its "
                    "manifest only; prepare it again there, or release with --data)"
                )
            if sha256_file(manifest) != released["manifest_sha256"]:
                raise UserError(
                    f"stage {entry['name']}: data source {source['name']} at {path} is not the data the stage "
                    f"trained on: its manifest's sha256 is not the recorded {released['manifest_sha256'][:12]}"
                )
            source["path"] = str(path)
        if configured:
            overrides[f"{section}.sources"] = configured
    return overrides


def replay_summary(replay: Replay) -> dict[str, Any]:
    return {
        "stage": replay.stage,
        "steps": replay.steps,
        "environment": replay.environment,
        "profile": replay.profile,
        "reason": replay.reason,
        "passed": replay.passed,
        "failure": replay.failure,
        "seed_runs": [str(run) for run in replay.seed_runs],
        "verdict": replay.verdict.as_dict() if replay.verdict is not None else None,
    }


def write_summary(replay: Replay, path: Path) -> None:
    path.write_text(json.dumps(replay_summary(replay), indent=2) + "\n", encoding="utf-8")
