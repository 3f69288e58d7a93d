"""Step timers that measure the same thing on every device.

On a CPU an operation has finished when its call returns, so `time.perf_counter`
around a region is its duration. On an accelerator the host only queues work, so a
host clock would time the queueing: there each region boundary records an event on
the current stream, and the events are read once, at the end of the step, after a
single synchronisation. A region therefore measures the time the current stream
spends between entering and leaving it; for a collective, that is the time the
compute stream is held up by it (wrap the call of a synchronous collective, or the
`wait()` of an asynchronous one), which is the communication the step actually pays.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

PHASES = ("forward", "backward", "optimizer", "generate")
WAITS = ("comm", "ep_wait")
REGIONS = PHASES + WAITS
_BLOCKED = "blocked"


@dataclass(frozen=True)
class StepTimes:
    """Seconds of one step; a region entered several times (micro-batches, layers) is summed.

    `blocked_s` is the time inside any waiting region (comm or ep_wait) counted once,
    so a collective inside a dispatch is not subtracted from compute twice.
    """

    step_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    comm_s: float
    ep_wait_s: float
    blocked_s: float
    generate_s: float = 0.0


class StepTimer:
    """`start()`, then `region(name)` around each part of the step, then `stop()` for its `StepTimes`.

    Regions nest (`comm` inside `ep_wait` inside `forward`) and repeat; a region must
    not be nested inside itself. Layers that cannot import ferry.metrics (comm sits
    below it) receive the timer object and only call `region` or `add`.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._on_host = device.type == "cpu"
        self._started = 0.0
        self._spans: list[tuple[str, object, object]] = []
        self._added = dict.fromkeys(REGIONS, 0.0)
        self._waiting = 0
        self._wait_began: object = None

    def start(self) -> None:
        self._started = time.perf_counter()
        self._spans = []
        self._added = dict.fromkeys(REGIONS, 0.0)
        self._waiting = 0

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        if name not in REGIONS:
            raise ValueError(f"unknown timer region {name!r}; regions are {', '.join(REGIONS)}")
        waits = name in WAITS
        began = self._mark()
        if waits:
            self._waiting += 1
            if self._waiting == 1:
                self._wait_began = began
        try:
            yield
        finally:
            ended = self._mark()
            self._spans.append((name, began, ended))
            if waits:
                self._waiting -= 1
                if self._waiting == 0:
                    self._spans.append((_BLOCKED, self._wait_began, ended))

    def add(self, name: str, seconds: float) -> None:
        """Time measured elsewhere (e.g. by a blocking host-side collective); counted as not overlapping."""
        if name not in REGIONS:
            raise ValueError(f"unknown timer region {name!r}; regions are {', '.join(REGIONS)}")
        self._added[name] += seconds

    def stop(self) -> StepTimes:
        if not self._on_host:
            torch.accelerator.synchronize(self.device)
        step_s = time.perf_counter() - self._started
        seconds = dict(self._added)
        seconds[_BLOCKED] = sum(self._added[name] for name in WAITS)
        for name, began, ended in self._spans:
            seconds[name] += self._elapsed(began, ended)
        return StepTimes(
            step_s=step_s,
            forward_s=seconds["forward"],
            backward_s=seconds["backward"],
            optimizer_s=seconds["optimizer"],
            comm_s=seconds["comm"],
            ep_wait_s=seconds["ep_wait"],
            blocked_s=seconds[_BLOCKED],
            generate_s=seconds["generate"],
        )

    def _mark(self) -> object:
        if self._on_host:
            return time.perf_counter()
        event = torch.Event(device=self.device, enable_timing=True)
        event.record(torch.accelerator.current_stream(self.device))
        return event

    def _elapsed(self, began, ended) -> float:
        if self._on_host:
            return ended - began
        return began.elapsed_time(ended) / 1000.0
