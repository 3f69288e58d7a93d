"""Progress of long work that is not a training step: scoring a reference, evaluating a checkpoint, a leg of a
rehearsal or drill. Whoever waits on it sees that it moves: a bar on a terminal, and where the output goes to a
file (a job's log, a CI console), a line at least every `LINE_EVERY_S` seconds, so minutes never pass in silence.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

LINE_EVERY_S = 30.0


def line_every_s() -> float:
    """The longest silence between lines to a file (read when a display starts, so tests can shorten it)."""
    return LINE_EVERY_S


class WorkProgress:
    """`update(done)` or `advance()` as the work moves; use as a context manager.

    `say` prints a line (None: this process stays silent, as ranks other than 0 do). `bar` asks for a rich bar
    when stderr is a terminal; a caller that already shows a live display (a training run's bar) passes False and
    gets lines instead. Lines say what is done out of what, and for how long it has run.
    """

    def __init__(
        self,
        label: str,
        total: int | None,
        say: Callable[[str], None] | None,
        unit: str = "",
        bar: bool = True,
        every_s: float | None = None,
        console: Console | None = None,
    ):
        self.label = label
        self.total = total
        self.unit = unit
        self.done = 0
        self._say = say
        self._every_s = line_every_s() if every_s is None else every_s
        self._started = time.perf_counter()
        self._last_line = self._started
        console = console or Console(stderr=True)
        self._bar = None
        if say is not None and bar and console.is_terminal:
            columns = (TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            self._bar = Progress(*columns, console=console, transient=True)
            self._task = self._bar.add_task(label, total=total)

    def __enter__(self) -> WorkProgress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc_info) -> None:
        if self._bar is not None:
            self._bar.stop()

    def advance(self, amount: int = 1) -> None:
        self.update(self.done + amount)

    def update(self, done: int) -> None:
        self.done = done
        if self._bar is not None:
            self._bar.update(self._task, completed=done)
            return
        now = time.perf_counter()
        if self._say is not None and now - self._last_line >= self._every_s:
            self._last_line = now
            self._say(self.line(now))

    def line(self, now: float | None = None) -> str:
        elapsed = (now or time.perf_counter()) - self._started
        out_of = f"/{self.total}" if self.total is not None else ""
        unit = f" {self.unit}" if self.unit else ""
        return f"ferry: {self.label}: {self.done}{out_of}{unit} after {elapsed:.0f} s"
