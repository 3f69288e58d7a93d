"""One finished run (`ferry train`) seen as a pipeline of one stage, so that it releases like one.

The stage is named after the run and records what its run directory holds: the resolved config it trained with,
its data with each dataset's manifest digest, its final checkpoint and figures; where it started from another
checkpoint (`init_from`), that checkpoint is its parent, by digest, as a pipeline's stage records a parent given
by path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ferry.checkpoint import list_checkpoints
from ferry.config import ConfigError, UserError
from ferry.data.manifest import sha256_file
from ferry.stages.lineage import LINEAGE_FILE, LINEAGE_FORMAT, LINEAGE_VERSION
from ferry.stages.runner import parent_at, stage_outcome, stage_record
from ferry.train.config import load_run_config
from ferry.train.run_dir.record import CONFIG_NAME, RUN_RECORD_NAME

RUN_KIND = "run"  # `pipeline.kind` of a one-run lineage (a pipeline file's has none)


def is_run_dir(directory: Path) -> bool:
    return (directory / RUN_RECORD_NAME).is_file() and (directory / CONFIG_NAME).is_file()


def run_lineage(run_dir: Path) -> dict[str, Any]:
    """The lineage of the finished run in `run_dir`; a run that has not completed is refused, saying how to
    finish it."""
    config_path = run_dir / CONFIG_NAME
    if not is_run_dir(run_dir):
        raise UserError(
            f"{run_dir} holds no pipeline ({LINEAGE_FILE} is missing) and no run ({RUN_RECORD_NAME} and "
            f"{CONFIG_NAME}): give a pipeline directory (ferry pipeline run --dir) or a run directory (ferry train's "
            "run.dir)"
        )
    try:
        config = load_run_config(config_path, [f"run.dir={run_dir}"])
    except ConfigError as exc:
        raise UserError(f"{config_path}: {exc}") from None
    if not list_checkpoints(config.checkpoint.path(config.run.path)):
        raise UserError(f"run {run_dir} saved no checkpoint (checkpoint.enabled false?): there is nothing to release")
    outcome = stage_outcome(config, 0)
    if outcome["status"] != "finished":
        raise UserError(
            f"run {run_dir} has not completed (its {RUN_RECORD_NAME} does not say completed): finish it with "
            f"`ferry train {config_path} resume=latest` before releasing it"
        )
    parent = None
    if config.init_from is not None:
        if not Path(config.init_from).exists():
            raise UserError(
                f"run {run_dir} started from init_from {config.init_from}, which is gone: a release names its "
                "parent checkpoint by digest"
            )
        parent = parent_at(Path(config.init_from), None)
    start = {
        "init_from": config.init_from,
        "carry": "weights+optimizer" if config.init_optimizer else "weights",
        "steps": "reset",
        "lr": None,
    }
    record = stage_record(config.run.name, start, config, parent, **outcome)
    pipeline = {"name": config.run.name, "file": str(config_path), "sha256": sha256_file(config_path), "kind": RUN_KIND}
    return {"format": LINEAGE_FORMAT, "version": LINEAGE_VERSION, "pipeline": pipeline, "stages": [record]}
