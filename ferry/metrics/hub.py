"""The sinks of one run behind one object: every sink gets the same record, and only rank 0 has sinks (the
experiment trackers among them, each on its own thread: `ferry.metrics.tracker_sink`)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from ferry.metrics.config import MetricsConfig
from ferry.metrics.console import ConsoleProgress
from ferry.metrics.jsonl import JsonlSink
from ferry.metrics.names import METRICS_FILE
from ferry.metrics.prometheus import PrometheusSink
from ferry.metrics.tensorboard import TensorBoardSink
from ferry.metrics.tracker_sink import TrackerSink


class MetricsHub:
    """`write(record)` each step, `message(text)` for lines people read, `close()` at the end.

    Messages go through the progress bar when there is one, so they do not tear it,
    and are printed even with the console sink off: warnings must not vanish with
    the step lines.
    """

    def __init__(
        self,
        sinks: list,
        console: ConsoleProgress | None = None,
        prometheus: PrometheusSink | None = None,
        speaks: bool = True,
        trackers: list[TrackerSink] | None = None,
    ):
        self.sinks = sinks
        self.console = console
        self.prometheus = prometheus
        self.trackers = trackers or []
        self._speaks = speaks
        self._plain = Console(highlight=False)

    def write(self, record: dict) -> None:
        if self.trackers:
            record["tracker_failures"] = sum(tracker.failures for tracker in self.trackers)
        for sink in [*self.sinks, *self.trackers]:
            sink.write(record)
        if self.console is not None:
            self.console.update(record)
        self._say_tracker_warnings()

    def message(self, text: str) -> None:
        if self.console is not None:
            self.console.message(text)
        elif self._speaks:
            self._plain.print(text, soft_wrap=True)

    def close(self) -> None:
        for sink in [*self.sinks, *self.trackers]:
            sink.close()
        self._say_tracker_warnings()
        if self.console is not None:
            self.console.close()

    def tracker_outcomes(self) -> dict:
        """Each tracker's run id and failures, once the hub is closed (run.json's `trackers`)."""
        return {tracker.tracker.name: tracker.outcome() for tracker in self.trackers}

    def _say_tracker_warnings(self) -> None:
        for tracker in self.trackers:
            for warning in tracker.warnings():
                self.message(warning)


def start_prometheus(config: MetricsConfig, rank: int, run_name: str) -> PrometheusSink | None:
    """Rank 0's Prometheus endpoint, if configured: opened before the run directory is touched, so that a port
    that cannot be had is refused with the earlier run still in place."""
    return PrometheusSink(config.sinks.prometheus, run_name) if rank == 0 and config.sinks.prometheus.enabled else None


def build_sinks(
    config: MetricsConfig,
    run_dir: Path,
    rank: int,
    *,
    run_name: str,
    total_steps: int,
    log_every: int,
    first_step: int = 0,
    prometheus: PrometheusSink | None = None,
    trackers: list[TrackerSink] | None = None,
) -> MetricsHub:
    """The hub of rank `rank`; ranks other than 0 get one that discards everything.

    Losses and expert loads are reduced over ranks before a record is built, so rank
    0's record stands for the step; several writers would fight over files and ports.
    `prometheus` is the endpoint `start_prometheus` opened, when it was opened before; `trackers` those
    `start_trackers` checked.
    """
    if rank != 0:
        return MetricsHub([], speaks=False)
    sinks = [JsonlSink(run_dir / METRICS_FILE)]
    try:
        if prometheus is None and config.sinks.prometheus.enabled:
            prometheus = PrometheusSink(config.sinks.prometheus, run_name)
        if prometheus is not None:
            sinks.append(prometheus)
        if config.sinks.tensorboard.enabled or "tensorboard" in config.trackers:
            sinks.append(TensorBoardSink(run_dir))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    console = ConsoleProgress(total_steps, log_every, first_step=first_step) if config.sinks.console else None
    return MetricsHub(sinks, console, prometheus, trackers=trackers)


def check_trackers(config: MetricsConfig, run_dir: Path, rank: int, run_name: str) -> list:
    """Rank 0's tracker adapters (`metrics.trackers` other than tensorboard, a sink of its own), their libraries
    imported now: one that is not installed is refused, with its install command, before the run directory is
    touched."""
    if rank != 0:
        return []
    from ferry.metrics.mlflow_tracker import MlflowTracker
    from ferry.metrics.wandb_tracker import WandbTracker

    adapters = {
        "wandb": lambda: WandbTracker(config.wandb, run_dir, run_name),
        "mlflow": lambda: MlflowTracker(config.mlflow, run_dir, run_name),
    }
    return [adapters[name]() for name in config.trackers if name in adapters]


def start_trackers(adapters: list, config: MetricsConfig, run_dir: Path) -> list[TrackerSink]:
    """Each adapter on its own thread, once the run directory (and run.json) is in place."""
    return [TrackerSink(adapter, run_dir, config.tracker_timeout_s) for adapter in adapters]
