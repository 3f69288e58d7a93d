"""The sinks of one run behind one object: every sink gets the same record, and only rank 0 has sinks."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from ferry.metrics.config import MetricsConfig
from ferry.metrics.console import ConsoleProgress
from ferry.metrics.jsonl import JsonlSink
from ferry.metrics.names import METRICS_FILE
from ferry.metrics.prometheus import PrometheusSink
from ferry.metrics.tensorboard import TensorBoardSink


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
    ):
        self.sinks = sinks
        self.console = console
        self.prometheus = prometheus
        self._speaks = speaks
        self._plain = Console(highlight=False)

    def write(self, record: dict) -> None:
        for sink in self.sinks:
            sink.write(record)
        if self.console is not None:
            self.console.update(record)

    def message(self, text: str) -> None:
        if self.console is not None:
            self.console.message(text)
        elif self._speaks:
            self._plain.print(text, soft_wrap=True)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        if self.console is not None:
            self.console.close()


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
) -> MetricsHub:
    """The hub of rank `rank`; ranks other than 0 get one that discards everything.

    Losses and expert loads are reduced over ranks before a record is built, so rank
    0's record stands for the step; several writers would fight over files and ports.
    `prometheus` is the endpoint `start_prometheus` opened, when it was opened before.
    """
    if rank != 0:
        return MetricsHub([], speaks=False)
    sinks = [JsonlSink(run_dir / METRICS_FILE)]
    try:
        if prometheus is None and config.sinks.prometheus.enabled:
            prometheus = PrometheusSink(config.sinks.prometheus, run_name)
        if prometheus is not None:
            sinks.append(prometheus)
        if config.sinks.tensorboard.enabled:
            sinks.append(TensorBoardSink(run_dir))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    console = ConsoleProgress(total_steps, log_every, first_step=first_step) if config.sinks.console else None
    return MetricsHub(sinks, console, prometheus)
