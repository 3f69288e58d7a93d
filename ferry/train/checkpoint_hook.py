"""Checkpoints at the run's interval, owned by one hook: when a save is due (a fixed `checkpoint.interval`, or
Young/Daly's from the failure rate and what a save costs, `checkpoint.interval: auto`), the save itself, timed
as the time training waits for it, and waiting for a save still in flight when the run ends.

It asks resilience only for what resilience owns, through narrow protocols: the hang watchdog (`Watch`: the
phase a save runs in, its clock restarted after) and the faults a drill injects into saves (`SaveFaults`: a
rank killed while its files are written, a byte flipped in a checkpoint just written).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from ferry.checkpoint import CheckpointConfig, CheckpointManager, SaveFailed
from ferry.train.hook_points import Hook, Watch
from ferry.train.resilience.faults import STORAGE_FAULTS
from ferry.train.resilience.young_daly import AutoInterval

CHECKPOINT_FAULTS = ("kill_during_save", "corrupt_checkpoint", *STORAGE_FAULTS)


class SaveFaults(Protocol):
    """What a drill injects into saves (`ferry.train.resilience.faults.FaultInjector`)."""

    def save_fault_step(self, kind: str, step: int, last_save_step: int, fixed_interval: bool) -> int | None: ...

    def during_save(self, step: int) -> Callable[[Path], None] | None: ...

    def wants_after_save(self, step: int) -> bool: ...

    def after_save(self, step: int, checkpoint: Path) -> None: ...

    def pending(self, kinds: tuple[str, ...]) -> list: ...


class CheckpointHook(Hook):
    """Saves at the interval (fixed or Young/Daly) and at the end, timed as the step's wait, and after each step
    learns how a save in flight ended; a failed save stops the run or, with `checkpoint.on_failure: continue`,
    is counted and training goes on. A failing run lets this rank's writer finish (its save is of an earlier,
    good step)."""

    def __init__(
        self,
        config: CheckpointConfig,
        job_mtbf_s: float,
        checkpoints: CheckpointManager,
        state: Callable[[], tuple],
        watch: Watch,
        faults: SaveFaults,
        agree: Callable[[list[float]], list[float]],
        say: Callable[[str], None],
        is_main: bool,
        resumed_step: int,
    ):
        """`state()`: this rank's pieces and the manifest's metadata at the current step; `agree(values)`: each
        value's maximum over the ranks (one Young/Daly interval on every rank); `resumed_step`: the step the run
        starts at, the last one saved."""
        self.config = config
        self.checkpoints = checkpoints
        self.state = state
        self.watch = watch
        self.faults = faults
        self.agree = agree
        self.say = say
        self.is_main = is_main
        self.auto = AutoInterval(job_mtbf_s, config.auto_first_step) if config.interval == "auto" else None
        self._last_save_step = resumed_step
        self.failed_saves = 0

    def before_training(self) -> None:
        """With `checkpoint.interval: auto` no one knows in advance at which steps the run saves: a checkpoint
        fault fires at the first save at or after its step (at the latest the run's last save)."""
        if self.auto is None or not self.is_main:
            return
        for index, spec in self.faults.pending(CHECKPOINT_FAULTS):
            self.say(
                f"ferry: note: fault.inject.{index} ({spec.kind} at step {spec.step} on rank {spec.rank}) fires at "
                f"the first checkpoint save at or after step {spec.step}: with checkpoint.interval auto, Daly's "
                "interval decides the steps that save"
            )

    def after_step(self, step: int, record: dict) -> None:
        if self.auto is not None:
            self.auto.observe_step(record["step_s"])
        self._by_policy(self.checkpoints.poll)
        record["checkpoint_interval_steps"] = self.interval_steps()
        if self._due(record["step"]):
            self.save(record["step"], record)
        record["checkpoint.blocked_s"], record["checkpoint.write_s"] = self.checkpoints.take_costs()
        record["checkpoint.failed_saves"] = self.failed_saves

    def after_training(self, step: int) -> None:
        if self.config.enabled and self.checkpoints.last_step != step:
            self.save(step, {})
        self.watch.phase("checkpoint save (finishing)")
        self._by_policy(self.checkpoints.wait)
        self.watch.touch()

    def on_error(self, exc: BaseException, last: dict) -> None:
        with contextlib.suppress(Exception):
            self.checkpoints.abandon()

    def _by_policy(self, saving: Callable[[], None]) -> None:
        """Run `saving` (a save, or learning how one ended); a failed save stops the run, or with
        `checkpoint.on_failure: continue` is counted and said, and training goes on (every rank alike)."""
        try:
            saving()
        except SaveFailed as failure:
            self.failed_saves += 1
            if self.config.on_failure == "stop":
                raise
            self.say(f"ferry: warning: {failure}; training goes on (checkpoint.on_failure: continue)")

    def _due(self, step: int) -> bool:
        if self.auto is not None:
            return self.config.enabled and self.auto.due(step, self.checkpoints.last_step)
        return self.checkpoints.due(step)

    def save(self, step: int, record: dict) -> None:
        """Save, timing what training waits for; the `auto` interval follows from that wait."""
        self.watch.phase("checkpoint save")
        fixed = self.auto is None
        during = None
        for kind in ("kill_during_save", *STORAGE_FAULTS):
            fault_step = self.faults.save_fault_step(kind, step, self._last_save_step, fixed)
            during = during or (None if fault_step is None else self.faults.during_save(fault_step))
        started = time.perf_counter()
        self._by_policy(lambda: self.checkpoints.save(*self.state(), before_publish=during))
        cost = time.perf_counter() - started
        if self.auto is not None:
            cost, median = self.agree([cost, self.auto.median_step_s() or 0.0])  # one interval on every rank
            self.auto.observe_save(cost, median or None)
            record["checkpoint_interval_steps"] = self.interval_steps()
            self.say(
                f"ferry: checkpoint at step {step} blocked {cost:.3f} s; Daly's interval for a job MTBF of "
                f"{self.auto.job_mtbf_s / 3600:.3g} h is {self.auto.interval_s:.1f} s = every "
                f"{self.auto.interval_steps} steps"
            )
        corrupt_step = self.faults.save_fault_step("corrupt_checkpoint", step, self._last_save_step, fixed)
        if corrupt_step is not None and self.faults.wants_after_save(corrupt_step):
            written = self.checkpoints.written_here()  # only this rank corrupts: no collective
            if written is not None:
                self.faults.after_save(corrupt_step, written)
        self._last_save_step = step
        self.watch.touch()
        self.watch.phase("between steps")

    def interval_steps(self) -> int | None:
        if self.auto is not None:
            return self.auto.interval_steps
        return self.config.interval or None

    def summary(self) -> dict:
        """How a run saved, for run.json: in the background or not and why (`checkpoint_async`), and at what
        interval (`checkpoint_interval`; None for a fixed one)."""
        if not self.is_main:
            return {}
        return {
            "checkpoint_async": {
                "setting": self.config.async_save,
                "on": self.checkpoints.asynchronous,
                "rule": self.checkpoints.async_rule,
            },
            "checkpoint_interval": None
            if self.auto is None
            else {
                "mode": "auto (Daly)",
                "job_mtbf_hours": self.auto.job_mtbf_s / 3600,
                "last_save_cost_s": self.auto.last_cost_s,
                "interval_s": self.auto.interval_s,
                "interval_steps": self.auto.interval_steps,
            },
        }
