"""`ferry pipeline run`: the stages in order, each a `ferry train` process in `DIR/<stage>/`.

A stage starts from scratch, from its parent's weights (and optimizer state), or continues
its parent's whole train state; which checkpoint that parent is, and its digest, is
decided before the stage runs and recorded in the lineage. Running the file again
skips finished stages, resumes an interrupted one from its own newest checkpoint, and
refuses a stage whose parent is no longer the checkpoint it started from, until
`--rerun STAGE` says to run it (and every later stage) again.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ferry.checkpoint import config_differences, find_resume_point, list_checkpoints
from ferry.checkpoint.digests import checkpoint_digest
from ferry.config import UserError, dump_yaml
from ferry.config.loader import validate
from ferry.data.manifest import sha256_file
from ferry.platform.fingerprint import code_version
from ferry.stages.lineage import Lineage, dataset_record
from ferry.stages.rerun import IMPORTS_DIR, SetAside
from ferry.stages.spec import (
    HF_PREFIX,
    PREVIOUS,
    STAGE_KEYS,
    PipelineSpec,
    StageSpec,
    load_pipeline,
    stage_configs,
)
from ferry.train.config import RunConfig
from ferry.train.run_dir.record import RUN_RECORD_NAME

CONFIGS_DIR = "configs"
# the held-out figures a stage's lineage keeps: the LM loss, DPO's reward accuracy, GRPO's solve rates
HELD_OUT_FIGURES = ("eval.loss", "eval/rewards/accuracy", "eval/solve_rate", "eval/greedy_solve_rate")
# keys not compared when a finished stage is met again: the runner's for each stage (what it starts from is
# compared as the stage's `start`), and settings that decide where and how far a run goes, not what it computes
_UNCOMPARED_KEYS = (*STAGE_KEYS, "run.overwrite", "run.host_allocator", "train.stop_at")


@dataclass(frozen=True)
class Parent:
    """The checkpoint a stage starts from."""

    checkpoint: Path
    digest: str
    step: int
    last_lr: float | None
    stage: str | None

    def as_record(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "checkpoint": str(self.checkpoint),
            "digest": self.digest,
            "step": self.step,
            "last_lr": self.last_lr,
        }


def run_pipeline(
    path: str | Path,
    directory: str | Path,
    overrides: list[str] = (),
    nproc: int = 1,
    rerun: str | None = None,
    say: Callable[[str], None] = print,
) -> Lineage:
    """Run every stage not yet finished; returns the lineage (the last stage's status says how far it got)."""
    spec = load_pipeline(path)
    configs = stage_configs(spec, overrides)
    directory = Path(directory)
    names = [stage.name for stage in spec.stages]
    if rerun is not None and rerun not in names:
        raise UserError(f"--rerun {rerun!r}: the pipeline's stages are {', '.join(names)}")
    pipeline = {"name": spec.name, "file": str(path), "sha256": sha256_file(Path(path))}
    lineage = Lineage(directory, pipeline, order=names)
    first_rerun = names.index(rerun) if rerun is not None else len(names)
    pending: SetAside | None = None
    try:
        for index, (stage, raw) in enumerate(zip(spec.stages, configs)):
            if index == first_rerun:
                pending = SetAside.stages(directory, names[first_rerun:], lineage)
            parent = _parent(spec, index, directory, lineage)
            config = _stage_config(raw, stage, directory / stage.name, parent)
            record = lineage.stages.get(stage.name)
            if record is not None:
                _check_parent(stage.name, record, parent)
                if record["status"] == "finished":
                    _check_unchanged(stage, record, config)
                    say(f"ferry: stage {stage.name}: finished earlier (step {record['result']['step']}); skipped")
                    continue
            started = {"attempts": (record or {}).get("attempts", 0) + 1, "started_at": time.time()}
            record = stage_record(stage.name, _start(stage), config, parent, status="running", **started)
            lineage.put(record)
            returncode = _train(config, directory, stage.nproc or nproc, stage.name, say)
            record.update(stage_outcome(config, returncode))
            lineage.put(record)
            if record["status"] == "refused":
                config_path = directory / CONFIGS_DIR / f"{stage.name}.yaml"
                kept = f"; the stages set aside for --rerun {rerun} are back as they were" if pending else ""
                raise UserError(
                    f"stage {stage.name} refused its input (exit 2, the reason is above); config {config_path}{kept}"
                )
            if pending is not None:  # the rerun got going: what it replaces is gone for good
                pending.discard()
                pending = None
            if record["status"] != "finished":
                stop_at = config.train.stop_at
                how = (
                    f"run the pipeline again with train.stop_at=null (or a later step than {stop_at}) to go on"
                    if record["status"] == "stopped" and stop_at is not None
                    else "run the pipeline again to resume it"
                )
                say(f"ferry: stage {stage.name} {record['status']}; {how}")
                return lineage
    except BaseException:
        if pending is not None:
            pending.restore(lineage)
        raise
    say(f"ferry: pipeline {spec.name}: every stage finished; lineage in {lineage.path}")
    return lineage


def _parent(spec: PipelineSpec, index: int, directory: Path, lineage: Lineage) -> Parent | None:
    stage = spec.stages[index]
    source = stage.init_from
    if source is None:
        return None
    if source == PREVIOUS:
        previous = spec.stages[index - 1].name
        record = lineage.stages.get(previous)
        if record is None or record["status"] != "finished":
            raise UserError(f"stage {stage.name} starts from {previous}, which has not finished")
        return parent_at(Path(record["result"]["checkpoint"]), previous)
    if source.startswith(HF_PREFIX):
        return parent_at(_imported(Path(source.removeprefix(HF_PREFIX)), directory / IMPORTS_DIR / stage.name), None)
    return parent_at(Path(source), None)


def parent_at(path: Path, stage: str | None) -> Parent:
    checkpoint = find_resume_point(str(path), path).checkpoint
    schedule = checkpoint.manifest.train_state.get("schedule") or {}
    ended_with = schedule.get("last_lr", schedule.get("next_lr"))  # checkpoints before `last_lr` was recorded
    return Parent(checkpoint.path, checkpoint_digest(checkpoint.path), checkpoint.step, ended_with, stage)


def _imported(hf_dir: Path, out: Path) -> Path:
    """The transformers directory as a ferry checkpoint, converted once per stage."""
    from ferry.interop import import_hf

    if not list_checkpoints(out / "checkpoints"):
        shutil.rmtree(out, ignore_errors=True)
        import_hf(hf_dir, out)
    return out / "checkpoints"


def _stage_config(raw: dict[str, Any], stage: StageSpec, run_dir: Path, parent: Parent | None) -> RunConfig:
    raw = copy.deepcopy(raw)
    raw.setdefault("run", {}).update({"dir": str(run_dir), "name": stage.name})
    raw["resume"] = "latest"  # the stage's own newest checkpoint when it was interrupted
    raw["init_from"], raw["init_optimizer"] = None, False
    if parent is not None:
        if stage.steps == "continue":
            stage_steps = validate(RunConfig, raw).train.steps
            raw.setdefault("train", {})["steps"] = parent.step + stage_steps
            if not list_checkpoints(run_dir / "checkpoints"):
                raw["resume"] = str(parent.checkpoint)
        else:
            raw["init_from"], raw["init_optimizer"] = str(parent.checkpoint), stage.carry == "weights+optimizer"
        if stage.lr == "parent":
            if parent.last_lr is None:
                raise UserError(f"stage {stage.name}: lr: parent, but {parent.checkpoint} records no learning rate")
            raw.setdefault("optim", {})["lr"] = parent.last_lr
    config = validate(RunConfig, raw)
    if not config.checkpoint.enabled:
        raise UserError(f"stage {stage.name}: checkpoint.enabled is false; a stage must leave a checkpoint")
    return config


def _check_parent(name: str, record: dict[str, Any], parent: Parent | None) -> None:
    recorded = (record.get("parent") or {}).get("digest")
    current = parent.digest if parent is not None else None
    if recorded != current:
        was = f"{record['parent']['checkpoint']} ({recorded[:12]})" if recorded else "scratch"
        now = f"{parent.checkpoint} ({current[:12]})" if parent is not None else "scratch"
        raise UserError(
            f"stage {name}: its parent changed since it ran (was {was}, now {now}); "
            f"pass --rerun {name} to run it and the stages after it again"
        )


def _check_unchanged(stage: StageSpec, record: dict[str, Any], config: RunConfig) -> None:
    name = stage.name
    differences = [
        str(difference)
        for difference in config_differences(record["config"], config.model_dump(mode="json"))
        if not difference.key.startswith(_UNCOMPARED_KEYS)
    ]
    start = _start(stage)
    differences += [
        f"{key}: it ran with {record['start'].get(key)}, this run {value}"
        for key, value in start.items()
        if record["start"].get(key) != value
    ]
    if differences:
        raise UserError(
            f"stage {name} finished with another config ({'; '.join(differences[:3])}); "
            f"pass --rerun {name} to run it and the stages after it again"
        )


def stage_record(
    name: str, start: dict[str, Any], config: RunConfig, parent: Parent | None, **fields: Any
) -> dict[str, Any]:
    """A stage's lineage record: where it starts (`start`: init_from, carry, steps, lr), from which parent
    checkpoint, with which config and data (each dataset's manifest digest), seed and code."""
    data = [dataset_record(source.name, source.path, source.weight) for source in config.data.sources]
    held_out = [dataset_record(source.name, source.path) for source in config.eval.sources]
    return {
        "name": name,
        **fields,
        "run_dir": str(config.run.path),
        "start": start,
        "parent": parent.as_record() if parent is not None else None,
        "config": config.model_dump(mode="json"),
        "data": data,
        "eval_data": held_out,
        "seed": config.run.seed,
        "code": code_version(),
    }


def _start(stage: StageSpec) -> dict[str, Any]:
    return {"init_from": stage.init_from, "carry": stage.carry, "steps": stage.steps, "lr": stage.lr}


def _train(config: RunConfig, directory: Path, nproc: int, name: str, say: Callable[[str], None]) -> int:
    config_path = directory / CONFIGS_DIR / f"{name}.yaml"
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(dump_yaml(config), encoding="utf-8")
    command = [sys.executable, "-m", "ferry", "train", str(config_path)]
    if nproc > 1:
        command += ["--nproc", str(nproc)]
    say(f"ferry: stage {name}: {' '.join(command[2:])}")
    return subprocess.run(command).returncode


def stage_outcome(config: RunConfig, returncode: int) -> dict[str, Any]:
    """How the stage ended; a finished one names its final checkpoint and figures."""
    run_record = _read_json(config.run.path / RUN_RECORD_NAME)
    status = run_record.get("status")
    outcome: dict[str, Any] = {"finished_at": time.time(), "returncode": returncode}
    if returncode != 0 or status != "completed":
        outcome["status"] = {0: "stopped", 2: "refused"}.get(returncode, "failed")
        return outcome
    final = find_resume_point("latest", config.checkpoint.path(config.run.path)).checkpoint
    last = run_record.get("last_step") or {}
    outcome["status"] = "finished"
    outcome["result"] = {
        "checkpoint": str(final.path),
        "digest": checkpoint_digest(final.path),
        "step": final.step,
        "loss": last.get("loss"),
        "eval_loss": last.get("eval.loss"),
        "eval": {key: last[key] for key in HELD_OUT_FIGURES if key in last},
        "data_mix": [
            {key: source.get(key) for key in ("name", "path", "weight", "tokens", "tokenizer_sha256", "shards")}
            for source in run_record.get("data_mix", [])
        ],
        # what each source gave the stage (windows, tokens, epochs), as run.json counted it from the data cursor
        "data_realised": run_record.get("data_realised", []),
    }
    return outcome


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
