"""What a training run does to survive failures, in one place the trainer calls at fixed points.

It composes the hang watchdog, the fault injector, the Young/Daly checkpoint interval and the
record of restarts and goodput, so the training loop stays a training loop:

    begin(...)            after the resume: the job's events (a fresh start, or a restart)
    before_step(step)     injected faults that strike as a step begins
    after_backward(...)   injected NaN gradients
    after_step(record)    the watchdog's heartbeat, the interval's step times, goodput in the record
    save_due(step)        a fixed interval or Young/Daly
    save(...)             a checkpoint, timed as training waits for it, with the save-time faults
    failed(exc)           what this rank says as it goes, for whoever restarts the job
    finish(record)        restarts and goodput into run.json
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from ferry.checkpoint import CheckpointManager
from ferry.train.config import RunConfig
from ferry.train.faults import FaultInjector
from ferry.train.restarts import (
    append_event,
    collect_causes,
    goodput,
    job_events,
    last_metrics_step,
    read_events,
    restart_is_pending,
    restarts,
    write_cause,
)
from ferry.train.run_record import METRICS_NAME, RunRecord
from ferry.train.watchdog import Watchdog
from ferry.train.young_daly import AutoInterval

Say = Callable[[str], None]


def restarted_by_torchrun() -> bool:
    """torchrun's elastic agent restarts every worker after a failure and counts the restarts."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


class Resilience:
    """Failure handling of one rank of one run."""

    def __init__(self, config: RunConfig, rank: int, world_size: int, started_unix: float):
        self.config = config
        self.rank = rank
        self.is_main = rank == 0
        self.world_size = world_size
        self.started_unix = started_unix
        self.run_dir = config.run.path
        self.step = 0
        self.injector = FaultInjector(config.fault.inject, rank, world_size, self.run_dir)
        self.watchdog = Watchdog(config.fault, rank, self._hung)
        job_mtbf_s = config.fault.mtbf_hours_per_device * 3600.0 / world_size
        interval = config.checkpoint.interval
        self.auto = AutoInterval(job_mtbf_s, config.checkpoint.auto_first_step) if interval == "auto" else None
        self._record: RunRecord | None = None
        self._restarting = False
        self._first_step_done = False
        self._resume_info: dict = {}
        self._productive = 0.0
        self._job_start_unix = started_unix
        self._say: Say = print
        self.agree: Callable[[list[float]], list[float]] = lambda values: values

    def begin(self, resumed_step: int | None, resume_info: dict, record: RunRecord | None, say: Say) -> None:
        """Note where this attempt starts: a new job (fresh, or resumed by hand) or the restart of one."""
        self._say = say
        self.step = resumed_step or 0
        self._record = record
        self._resume_info = resume_info
        if self.is_main:
            events = read_events(self.run_dir)
            self._restarting = restart_is_pending(events)
            if not self._restarting:
                loading = (resume_info.get("verify_s") or 0.0) + (resume_info.get("restore_s") or 0.0)
                append_event(
                    self.run_dir,
                    {"event": "start", "at_unix": self.started_unix, "step": self.step, "loading_s": loading},
                )
            starts = [event for event in read_events(self.run_dir) if event["event"] == "start"]
            self._job_start_unix = starts[-1]["at_unix"] if starts else self.started_unix
            self._productive = sum(record.get("step_s") or 0.0 for record in self._kept_records())
        self.watchdog.start(self.step)

    def note_agent_restart(self) -> None:
        """Under torchrun, no ferry supervisor recorded the failure: rank 0 does, once per restart torchrun
        counts, before the run's records are cut back to the checkpoint it resumes from (they still say how
        far the failed attempt got). torchrun does not say how the ranks ended; what they reported does."""
        if not (self.is_main and restarted_by_torchrun()):
            return
        count = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        recorded = [e for e in job_events(read_events(self.run_dir)) if e.get("by") == "torchrun"]
        if recorded and recorded[-1].get("restart_count", 0) >= count:
            return
        metrics = self.run_dir / METRICS_NAME
        last_written = metrics.stat().st_mtime if metrics.exists() else time.time()
        event = self.failure_event("torchrun", {}, time.time(), fallback_at=last_written)
        append_event(self.run_dir, {**event, "restart_count": count})

    def failure_event(self, by: str, exit_codes: dict, detected_unix: float, fallback_at: float) -> dict:
        """The event that says the job failed: what the ranks said, how far it got, when (the first report,
        else `fallback_at`)."""
        causes = collect_causes(self.run_dir)
        at = min(cause["at_unix"] for cause in causes) if causes else fallback_at
        return {
            "event": "failure",
            "by": by,
            "at_unix": at,
            "detected_unix": detected_unix,
            "failed_at_step": last_metrics_step(self.run_dir),
            "causes": causes,
            "exit_codes": exit_codes,
        }

    def before_step(self, step: int) -> None:
        self.step = step - 1
        self.watchdog.phase("data")
        self.injector.at_step_start(step, on_hang=lambda: self.watchdog.phase("a hang (injected fault)"))

    def phase(self, name: str) -> None:
        self.watchdog.phase(name)

    def after_backward(self, step: int, model) -> None:
        self.injector.poison_gradients(step, model)

    def after_step(self, record: dict) -> None:
        """The heartbeat; goodput and the checkpoint interval in the step's record."""
        self.step = record["step"]
        self.watchdog.beat(record["step"], record["step_s"])
        if self.auto is not None:
            self.auto.observe_step(record["step_s"])
        record["checkpoint_save_s"] = 0.0
        record["checkpoint_interval_steps"] = self._interval_steps()
        if self.is_main:
            self._productive += record["step_s"]
            record["goodput"] = self._productive / max(time.time() - self._job_start_unix, 1e-9)
            if not self._first_step_done and self._restarting:
                # back at work when the first step began: its own time is productive, not restarting
                began = time.time() - record["step_s"]
                append_event(
                    self.run_dir,
                    {"event": "resumed", "at_unix": began, "step": record["step"] - 1, **self._resume_info},
                )
            if not self._first_step_done and self._record is not None:
                self._record.update(first_step_at_unix=time.time())
        else:
            record["goodput"] = None
        self._first_step_done = True

    def save_due(self, step: int, checkpoints: CheckpointManager) -> bool:
        if self.auto is not None:
            return self.config.checkpoint.enabled and self.auto.due(step, checkpoints.last_step)
        return checkpoints.due(step)

    def save(self, step: int, checkpoints: CheckpointManager, state: Callable[[], tuple], record: dict) -> None:
        """Save, timing what training waits for; the `auto` interval follows from that wait."""
        self.watchdog.phase("checkpoint save")
        started = time.perf_counter()
        checkpoints.save(*state(), before_publish=self.injector.during_save(step))
        cost = time.perf_counter() - started
        record["checkpoint_save_s"] = cost
        if self.auto is not None:
            cost, median = self.agree([cost, self.auto.median_step_s() or 0.0])  # one interval on every rank
            self.auto.observe_save(cost, median or None)
            record["checkpoint_interval_steps"] = self._interval_steps()
            self._say(
                f"ferry: checkpoint at step {step} blocked {cost:.3f} s; Daly's interval for a job MTBF of "
                f"{self.auto.job_mtbf_s / 3600:.3g} h is {self.auto.interval_s:.1f} s = every "
                f"{self.auto.interval_steps} steps"
            )
        if self.injector.wants_after_save(step):
            checkpoints.wait()
            self.injector.after_save(step, checkpoints.saved[-1])
        self.watchdog.touch()
        self.watchdog.phase("between steps")

    def evaluate(self, run: Callable[[Callable[[], None]], dict]) -> dict:
        """A held-out evaluation: each of its forwards restarts the hang clock (a long one is not a hang)."""
        self.watchdog.phase("evaluation")
        self.watchdog.touch()
        figures = run(self.watchdog.touch)
        self.watchdog.touch()
        self.watchdog.phase("between steps")
        return figures

    def wait_for_saves(self, checkpoints: CheckpointManager) -> None:
        """The end of the run waits for a background save: watched with the checkpoint allowance."""
        self.watchdog.phase("checkpoint save (finishing)")
        checkpoints.wait()
        self.watchdog.touch()

    def failed(self, exc: BaseException) -> None:
        """Leave this rank's account of the failure in the run directory."""
        if isinstance(exc, KeyboardInterrupt):
            return
        write_cause(self.run_dir, self.rank, self.step + 1, self.watchdog.current_phase, f"{type(exc).__name__}: {exc}")

    def finish(self) -> dict:
        """Restarts and goodput of the job so far, for run.json."""
        self.watchdog.stop()
        if not self.is_main:
            return {}
        events = read_events(self.run_dir)
        return {
            "restarts": restarts(events),
            "goodput": goodput(events, self._all_records(), time.time()),
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

    def _interval_steps(self) -> int | None:
        if self.auto is not None:
            return self.auto.interval_steps
        interval = self.config.checkpoint.interval
        return interval or None

    def _hung(self, phase: str, message: str) -> None:
        write_cause(self.run_dir, self.rank, self.step + 1, phase, f"hang: {message}")

    def _all_records(self) -> list[dict]:
        from ferry.metrics.jsonl import read_metrics

        path = self.run_dir / METRICS_NAME
        return read_metrics(path) if path.exists() and path.stat().st_size else []

    def _kept_records(self) -> list[dict]:
        starts = [event for event in read_events(self.run_dir) if event["event"] == "start"]
        first = starts[-1]["step"] if starts else 0
        return [record for record in self._all_records() if record["step"] > first]
