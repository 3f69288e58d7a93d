"""`ferry train`: a run in this process, or N local ranks started and (with --max-restarts) supervised; the same
for `ferry release branch`, which composes the config it trains."""

from __future__ import annotations

import os

from ferry.config import UserError
from ferry.platform.process import Stopped, die_with_parent, stop_on_sigterm


def run_training(
    config_path: str,
    overrides: list[str],
    nproc: int | None = None,
    model: str | None = None,
    max_restarts: int | None = None,
) -> int:
    """`ferry train CONFIG [KEY=VALUE ...] [--nproc N] [--model PRESET] [--max-restarts K]`, as `ferry train` and
    `ferry release branch` run it: in this process, or on N local ranks (supervised with --max-restarts)."""
    from ferry.train import load_run_config, train

    preset = []
    if model is not None:
        from ferry.model.presets import preset_overrides

        preset = preset_overrides(model)
    config = load_run_config(config_path, [*preset, *overrides])
    if nproc is not None and nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {nproc}")
    if max_restarts is not None and max_restarts < 0:
        raise UserError(f"--max-restarts must be 0 or more, got {max_restarts}")
    if "WORLD_SIZE" not in os.environ and (max_restarts is not None or nproc is not None):
        config.check_world_size(nproc or 1)  # refused here, before any rank starts
        return _launch(config_path, overrides, nproc, model, max_restarts, config)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # a rank started by an elastic agent (torchrun, --nproc) dies with it, and by the agent's SIGTERM at once:
        # a rank blocked in a collective would not run a handler until the collective returned, which after a
        # peer's failure can be never, and each restart would wait out the agent's grace period
        die_with_parent()
    else:
        stop_on_sigterm()
    train(config)
    return 0


def _launch(
    config_path: str, overrides: list[str], nproc: int | None, model: str | None, max_restarts: int | None, config
) -> int:
    """Start the ranks (supervised with --max-restarts); a launcher told to stop says so in the run's record,
    since its ranks end by the signal without a word."""
    argv = ["train", config_path, *(["--model", model] if model else []), *overrides]
    try:
        if max_restarts is not None:
            from ferry.launch import supervise

            checkpoints = config.checkpoint.path(config.run.path)
            return supervise(
                nproc or 1,
                argv,
                config.run.path,
                checkpoints,
                max_restarts,
                config.fault.max_no_progress_restarts,
            )
        from ferry.launch import launch_local

        return launch_local(nproc, argv)
    except Stopped as stopped:
        from ferry.train.run_dir.record import RUN_RECORD_NAME, RunRecord

        if (config.run.path / RUN_RECORD_NAME).is_file():
            record = RunRecord.reopen(config.run.path)
            if record.content.get("status") == "running":
                record.finish("interrupted", signal=str(stopped))
        raise
