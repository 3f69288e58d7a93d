"""Opening a run's directory and sinks on every rank, and saying what it set aside there.

The main rank locks the directory against a second live run (`run_lock.py`) and writes it (its config,
`run.json`, the checkpoints a resume leaves behind moved aside); every rank builds its metrics sinks (the
others' discard). A user error any rank meets doing so
stops every rank with the same message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ferry.checkpoint import CheckpointManager, list_checkpoints, set_aside_abandoned
from ferry.checkpoint.format import parse_step
from ferry.comm import raise_on_every_rank
from ferry.metrics import MetricsHub, build_sinks, check_trackers, start_prometheus, start_trackers
from ferry.train.announcements import resume_record
from ferry.train.run_dir.lock import RunDirLock
from ferry.train.run_dir.record import RunRecord, prepare_run_dir

if TYPE_CHECKING:
    from ferry.checkpoint.reader import Found
    from ferry.train.assembly import Job
    from ferry.train.state import TrainState


@dataclass
class OpenedRun:
    """The run directory's record and lock (main rank only), the sinks, and the checkpoints moved aside
    (old, new)."""

    record: RunRecord | None
    hub: MetricsHub
    abandoned: list[tuple[Path, Path]] = field(default_factory=list)
    lock: RunDirLock | None = None
    replaced: Path | None = None  # where `run.overwrite` kept an earlier run that went further than this one will


def open_run(
    job: Job,
    description: dict,
    state: TrainState,
    found: Found | None,
    resumed_step: int | None,
    resume_times: dict,
) -> OpenedRun:
    """Prepare the run directory and the sinks of the run at `state`, resumed at `resumed_step` (None: fresh);
    run.json opens with `description` (`ferry.train.announcements.describe`)."""
    config = job.config
    run_dir = config.run.path

    def on_this_rank() -> OpenedRun:
        prometheus = start_prometheus(config.metrics, job.rank, config.run.name)
        lock = None
        trackers = []
        try:
            record, abandoned, replaced = None, [], None
            adapters = check_trackers(config.metrics, run_dir, job.rank, config.run.name)
            if job.is_main:
                lock = RunDirLock.acquire(run_dir)
                replaced = prepare_run_dir(config, resume_step=resumed_step)
                if found and found.checkpoint:
                    checkpoint_dir = config.checkpoint.path(run_dir)
                    abandoned = set_aside_abandoned(checkpoint_dir, resumed_step, found.checkpoint.path)
                resumed_from = resume_record(found, state.carried, resume_times)
                record = RunRecord(run_dir, {**description, "resumed_from": resumed_from})
            trackers = start_trackers(adapters, config.metrics, run_dir)
            hub = build_sinks(
                config.metrics,
                run_dir,
                job.rank,
                run_name=config.run.name,
                total_steps=config.train.steps,
                log_every=config.train.log_every,
                first_step=state.step,
                prometheus=prometheus,
                trackers=trackers,
            )
        except BaseException:
            if prometheus is not None:
                prometheus.close()
            for tracker in trackers:
                tracker.close()
            if lock is not None:
                lock.release()
            raise
        return OpenedRun(record, hub, abandoned, lock, replaced)

    return raise_on_every_rank(job.context, on_this_rank)


def report_set_aside(
    opened: OpenedRun, checkpoints: CheckpointManager, resumed_step: int | None, last_step: int
) -> None:
    """Warn of the unfinished saves removed, the checkpoints set aside and an earlier run kept, and record them in
    `run.json`."""
    for leftover in checkpoints.removed_leftovers:
        opened.hub.message(f"ferry: warning: removed the unfinished save {leftover} (its process died mid-save)")
    if opened.abandoned:
        names = ", ".join(old.name for old, _ in opened.abandoned)
        opened.hub.message(
            f"ferry: warning: this run goes on from step {resumed_step}; the checkpoints it leaves behind "
            f"({names}) are set aside in {opened.abandoned[0][1].parent}, where resume=latest does not look"
        )
    if opened.replaced is not None:
        reached = max(parse_step(path) for path in list_checkpoints(opened.replaced / "checkpoints"))
        opened.hub.message(
            f"ferry: warning: run.overwrite: the earlier run in {opened.replaced.parent.parent} reached step "
            f"{reached}, "
            f"past this run's last step ({last_step}), so it is kept, not deleted, in {opened.replaced}; delete it "
            "when you no longer need it"
        )
    if opened.record is not None:
        opened.record.update(
            replaced_run=str(opened.replaced) if opened.replaced is not None else None,
            removed_unfinished_saves=[str(path) for path in checkpoints.removed_leftovers],
            abandoned_checkpoints={str(old): str(new) for old, new in opened.abandoned},
        )
