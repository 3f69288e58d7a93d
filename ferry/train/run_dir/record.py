"""The run directory: resolved config, run manifest (`run.json`) and metrics, owned by one run."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

import yaml

from ferry.checkpoint import clear_checkpoints, list_checkpoints
from ferry.checkpoint.format import parse_step, step_dir_name
from ferry.checkpoint.manager import ABANDONED_DIR
from ferry.config import UserError, dump_yaml
from ferry.metrics.names import RECORD_DIRS, RUN_RECORD_FILE, TRACKER_IDS_FILE

CONFIG_NAME = "config.yaml"
RUN_RECORD_NAME = RUN_RECORD_FILE
METRICS_NAME = "metrics.jsonl"
EVENTS_NAME = "restarts.jsonl"
FAULTS_DIR = ".faults"
REPLACED_DIR = "replaced"
_RUN_FILES = (CONFIG_NAME, RUN_RECORD_NAME, METRICS_NAME, EVENTS_NAME, TRACKER_IDS_FILE)


class RecordedRun(Protocol):
    """What the run directory reads of a run config (`ferry.train.config.RunConfig`, which is composed above this
    package): where the run and its checkpoints live, whether it may replace another, how far it goes; dumped
    whole as `config.yaml`."""

    run: Any
    checkpoint: Any
    train: Any

    def model_dump(self, **kwargs) -> dict: ...


def prepare_run_dir(config: RecordedRun, resume_step: int | None = None) -> Path | None:
    """Create `run.dir` and write the resolved config; returns where an earlier run was kept, if one was.

    A fresh start refuses to mix with an earlier run's records and checkpoints
    (`run.overwrite=true` deletes them, unless the earlier run's checkpoints went further than this run
    will: that run is moved whole into `replaced/` instead, since a config that sets `run.overwrite` to rerun a
    demo would otherwise delete a long run for a short test). A resumed run continues its records
    instead: metrics of steps after `resume_step` belong to the part of the run
    that was lost, so they are dropped and `metrics.jsonl` holds each step once.
    """
    run_dir = config.run.path
    checkpoints = config.checkpoint.path(run_dir)
    if resume_step is None:
        earlier = [name for name in _RUN_FILES if (run_dir / name).exists()]
        if list_checkpoints(checkpoints):
            earlier.append(f"checkpoints in {checkpoints}")
        if earlier and not config.run.overwrite:
            raise UserError(
                f"run.dir {str(run_dir)!r} already holds a run ({', '.join(earlier)}); choose another run.dir, "
                "set resume=latest to continue it, or set run.overwrite=true to replace it"
            )
        if list_checkpoints(checkpoints) and not _owned_checkpoints(run_dir, checkpoints):
            raise UserError(
                f"checkpoint.dir {str(checkpoints)!r} holds the checkpoints of a run other than the one in run.dir "
                f"{str(run_dir)!r}, which run.overwrite does not replace; choose another checkpoint.dir"
            )
        kept = _keep_a_further_run(run_dir, checkpoints, config.train.steps)
        for name in _RUN_FILES:
            (run_dir / name).unlink(missing_ok=True)
        for name in RECORD_DIRS:
            shutil.rmtree(run_dir / name, ignore_errors=True)
        shutil.rmtree(run_dir / FAULTS_DIR, ignore_errors=True)  # fired faults and causes belong to the old run
        clear_checkpoints(checkpoints)
    else:
        kept = None
        _drop_metrics_after(run_dir / METRICS_NAME, resume_step)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_NAME).write_text(dump_yaml(config), encoding="utf-8")
    return kept


def _keep_a_further_run(run_dir: Path, checkpoints: Path, steps: int) -> Path | None:
    """Move the earlier run's records and checkpoints into `replaced/<time>-reached-step-N/` when its newest
    checkpoint is past `steps`, the last step the new run will reach; None when there is no such run."""
    reached = max((parse_step(path) for path in list_checkpoints(checkpoints)), default=0)
    if reached <= steps:
        return None
    folder = run_dir / REPLACED_DIR / f"{time.strftime('%Y%m%dT%H%M%S')}-reached-{step_dir_name(reached)}"
    while folder.exists():
        folder = folder.with_name(folder.name + "-again")
    (folder / "checkpoints").mkdir(parents=True)
    for name in (*_RUN_FILES, *RECORD_DIRS, FAULTS_DIR):
        if (run_dir / name).exists():
            shutil.move(run_dir / name, folder / name)
    for path in [*list_checkpoints(checkpoints), checkpoints / ABANDONED_DIR]:
        if path.exists():
            shutil.move(path, folder / "checkpoints" / path.name)
    return folder


def _owned_checkpoints(run_dir: Path, checkpoints: Path) -> bool:
    """Whether `checkpoints` belong to the run in `run_dir`: they lie inside it, or its config names them."""
    if checkpoints.resolve().is_relative_to(run_dir.resolve()):
        return True
    try:
        earlier = yaml.safe_load((run_dir / CONFIG_NAME).read_text(encoding="utf-8"))
        named = earlier["checkpoint"]["dir"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return False
    return named is not None and Path(named).resolve() == checkpoints.resolve()


def _drop_metrics_after(path: Path, step: int) -> None:
    """Keep the records of steps up to `step`; a line cut short by a crash is dropped too."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue
    temporary = path.with_suffix(".jsonl.tmp")
    temporary.write_text("".join(kept), encoding="utf-8")
    os.replace(temporary, path)


class RunRecord:
    """`run.json`: what ran, on what, from which data and code, and how it ended.

    Rewritten atomically at start and end so a reader never sees half a file.
    """

    def __init__(self, run_dir: Path, content: dict):
        self.path = run_dir / RUN_RECORD_NAME
        self.content = {"status": "running", "started_at": _now(), **content}
        self.save()

    @classmethod
    def reopen(cls, run_dir: Path) -> RunRecord:
        """The `run.json` a run left, to be amended by whoever outlives it (a supervisor that gave up);
        an empty record when the run died before writing one, or left it unreadable."""
        record = cls.__new__(cls)
        record.path = run_dir / RUN_RECORD_NAME
        try:
            content = json.loads(record.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            content = None
        record.content = content if isinstance(content, dict) else {"status": "running"}
        return record

    def update(self, **fields) -> None:
        self.content.update(fields)
        self.save()

    def finish(self, status: str, **fields) -> None:
        self.update(status=status, finished_at=_now(), **fields)

    def save(self) -> None:
        temporary = self.path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(self.content, indent=1, default=str), encoding="utf-8")
        os.replace(temporary, self.path)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
