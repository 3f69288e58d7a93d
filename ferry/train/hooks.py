"""Everything around a step, as hooks at the named points of `ferry.train.hook_points`, so the training loop
reads as the loop it is: the torch trace, held-out evaluation and the run's records here; the checkpoints
(`ferry.train.checkpoint_hook`) and resilience (`ferry.train.resilience.core.Resilience`) are two more."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ferry.checkpoint import CheckpointManager
from ferry.metrics import MetricsHub, StepMetrics, TorchTrace
from ferry.metrics.progress import WorkProgress
from ferry.platform.process import Stopped
from ferry.train.announcements import eval_line
from ferry.train.hook_points import Hook, RunEnd, Watch
from ferry.train.run_dir.record import RunRecord


class TraceHook(Hook):
    """The torch profiler's schedule follows the steps (`profile` settings)."""

    def __init__(self, trace: TorchTrace):
        self.trace = trace

    def before_step(self, step: int) -> None:
        self.trace.step_started(step)

    def after_step(self, step: int, record: dict) -> None:
        self.trace.step_finished(record["step"])

    def at_close(self, end: RunEnd | None) -> None:
        self.trace.close()


class EvaluationHook(Hook):
    """Held-out evaluation after the steps it is due at; its figures join the step's record. Each of its forwards
    restarts the hang clock (a long evaluation is not a hang), and a long one says how far it is (`say`, at least
    every 30 s)."""

    def __init__(
        self,
        watch: Watch,
        due: Callable[[int], bool],
        evaluate: Callable[[Callable[[], None]], dict],
        say: Callable[[str], None],
    ):
        self.watch = watch
        self.due = due
        self.evaluate = evaluate
        self.say = say

    def after_step(self, step: int, record: dict) -> None:
        if not self.due(record["step"]):
            return
        label = f"held-out evaluation at step {record['step']}"
        with WorkProgress(label, None, say=self.say, unit="forwards", bar=False) as work:

            def progress() -> None:
                self.watch.touch()
                work.advance()

            self.watch.phase("evaluation")
            self.watch.touch()
            record.update(self.evaluate(progress))
            self.watch.touch()
            self.watch.phase("between steps")


class RecordsHook(Hook):
    """Every step's record to the sinks (metrics.jsonl, console, Prometheus, TensorBoard), with the warnings the
    metrics gathered and the held-out line; `run.json`'s ending (completed, stopped, interrupted, failed) with
    restarts and goodput; the run's closing lines."""

    def __init__(
        self,
        hub: MetricsHub,
        record: RunRecord | None,
        metrics: StepMetrics,
        outcome: Callable[[], dict],
        checkpoints: CheckpointManager,
        run_dir: Path,
        steps: int,
        stop_after: int | None,
        describe_hardware: Callable[[], dict],
        data_realised: Callable[[], list[dict]] = list,
    ):
        """`outcome()`: the restarts, goodput and checkpoint interval run.json ends with (resilience's and the
        checkpoint hook's); `steps`: the run's last step; `stop_after`: `train.stop_at` as configured (for the
        closing line);
        `describe_hardware()`: run.json's hardware section, written again at the end (a measured peak may have
        been measured again); `data_realised()`: what each data source gave the run so far (run.json's
        `data_realised`, written at the end however the run ends)."""
        self.hub = hub
        self.record = record
        self.metrics = metrics
        self.outcome = outcome
        self.checkpoints = checkpoints
        self.run_dir = run_dir
        self.steps = steps
        self.stop_after = stop_after
        self.describe_hardware = describe_hardware
        self.data_realised = data_realised

    def after_step(self, step: int, record: dict) -> None:
        self.hub.write(record)
        for note in self.metrics.take_notes():
            self.hub.message(note)
        if any(key.startswith("eval") for key in record):
            self.hub.message(eval_line(record))

    def on_error(self, exc: BaseException, last: dict) -> None:
        if self.record is None:
            return
        if isinstance(exc, (KeyboardInterrupt, Stopped)):  # stopped from outside: no failure of the run
            stopped_by = exc.args[0] if isinstance(exc, Stopped) else "SIGINT"
            self.record.finish(
                "interrupted", signal=stopped_by, last_step=last, data_realised=self.data_realised(), **self.outcome()
            )
        else:
            self.record.finish(
                "failed",
                error=f"{type(exc).__name__}: {exc}",
                last_step=last,
                data_realised=self.data_realised(),
                **self.outcome(),
            )

    def at_close(self, end: RunEnd | None) -> None:
        if end is not None:
            self._finish(end)
        self.hub.close()
        if self.record is not None and self.hub.trackers:
            self.record.update(trackers=self.hub.tracker_outcomes())

    def _finish(self, end: RunEnd) -> None:
        status = "completed" if end.step >= self.steps else "stopped"
        outcome = self.outcome()
        if self.record is not None:
            self.record.finish(
                status,
                last_step=end.last,
                checkpoints=[str(path) for path in self.checkpoints.saved],
                hardware=self.describe_hardware(),
                data_realised=self.data_realised(),
                **outcome,
            )
        if outcome.get("restarts"):
            good = outcome["goodput"]
            self.hub.message(
                f"ferry: {len(outcome['restarts'])} restart(s), {good['lost_steps']} step(s) lost; goodput "
                f"{good['goodput']:.1%} ({good['productive_s']:.1f} s of steps in {good['wall_s']:.1f} s)"
            )
        if not end.trained:
            self.hub.message(
                f"ferry: nothing to train: the run is at step {end.step} and stops at {end.stop_at} "
                f"(train.steps {self.steps}, train.stop_at {self.stop_after}); run in {self.run_dir}"
            )
        else:
            ending = "done" if status == "completed" else f"stopped at step {end.step}"
            self.hub.message(f"ferry: {ending} — final loss {end.last['loss']:.4f}; run in {self.run_dir}")
