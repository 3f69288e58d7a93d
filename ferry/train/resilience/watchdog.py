"""Hang detection: a thread on every rank ends its process when no step completes in time.

A rank stuck in a collective, a kernel or a dead data source makes no progress and raises no
error; torchrun's agent would wait for it forever. The watchdog knows the phase the rank is in
(forward, backward, optimizer, a checkpoint save) and how long a step takes, reports where it
is stuck (on stderr and in the run directory, for whoever restarts the job) and ends the process
with `HANG_EXIT_CODE`; the launcher then stops the other ranks, which works whatever the
collective backend (gloo on a CPU cannot abort a collective; NCCL need not).
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections.abc import Callable

from ferry.comm.collectives import waiting_in
from ferry.train.resilience.config import FaultConfig

HANG_EXIT_CODE = 3
_WARMUP_STEPS = 3  # step times before these are left out of the median (allocation, first kernels)


class Watchdog:
    """Per-rank progress monitor; `beat` after every step, `phase` as the step moves on."""

    def __init__(self, config: FaultConfig, rank: int, on_hang: Callable[[str, str, str | None], None]):
        """`on_hang(phase, message, waiting)` records the cause before the process ends (`waiting`: the collective
        the rank was waiting in for its peers, if any)."""
        self.config = config
        self.rank = rank
        self.on_hang = on_hang
        self.current_phase = "start-up"
        self.step = 0
        self._steps_here = 0
        self._times: list[float] = []
        self._slowest_warmup = 0.0
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.config.hang_timeout_s is not None

    def start(self, step: int) -> None:
        """Watch from now (the clock restarts); a watchdog already watching (the load before the first step)
        goes on in the same thread."""
        self.step = step
        self._last = time.monotonic()
        self._stop.clear()
        if self.enabled and not (self._thread is not None and self._thread.is_alive()):
            self._thread = threading.Thread(target=self._watch, name="ferry-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def phase(self, name: str) -> None:
        self.current_phase = name

    def beat(self, step: int, step_s: float) -> None:
        """A step completed: the clock restarts, and its time feeds the automatic timeout."""
        self.step = step
        self._steps_here += 1
        if self._steps_here > _WARMUP_STEPS:
            self._times.append(step_s)
        else:
            self._slowest_warmup = max(self._slowest_warmup, step_s)
        self.touch()
        self.current_phase = "between steps"

    def touch(self) -> None:
        """Work other than a step just ended (a checkpoint save): the next step gets a whole window."""
        self._last = time.monotonic()

    def timeout_s(self) -> float:
        """How long the current phase may go without a completed step."""
        config = self.config
        if config.hang_timeout_s == "auto":
            # after the warm-up the median step; during it the slowest step so far (a slow model's steps
            # are slow from the start, and the floor alone would kill it at its second step)
            typical = statistics.median(self._times) if self._times else self._slowest_warmup
            base = max(config.hang_floor_s, config.hang_multiple * typical)
        else:
            base = float(config.hang_timeout_s)
        if self._steps_here == 0:
            base += config.hang_first_step_s
        if self.current_phase.startswith("checkpoint"):
            base += config.hang_checkpoint_s
        return base

    def overdue(self) -> str | None:
        """What is wrong when the rank has gone past its limit (None while it has not)."""
        waited = time.monotonic() - self._last
        limit = self.timeout_s()
        if waited <= limit:
            return None
        waiting = waiting_in()
        peers = f", waiting in {waiting} for its peers" if waiting else ""
        return (
            f"no step completed for {waited:.1f} s (limit {limit:.1f} s): stuck in {self.current_phase} of step "
            f"{self.step + 1}{peers}"
        )

    def _watch(self) -> None:
        while not self._stop.wait(0.25):
            message = self.overdue()
            if message is not None:
                try:
                    self.on_hang(self.current_phase, message, waiting_in())
                finally:
                    print(f"ferry: rank {self.rank}: error: {message}", file=sys.stderr, flush=True)
                    os._exit(HANG_EXIT_CODE)
