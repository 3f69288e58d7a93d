"""Time and bytes spent in collectives, per operation: the raw material of comm/compute metrics."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class CommStats:
    """Accumulates per-op figures until `take()` hands them to the step's metrics and starts afresh."""

    ops: dict[str, OpStats] = field(default_factory=lambda: defaultdict(OpStats))

    def record(self, op: str, num_bytes: int, seconds: float) -> None:
        entry = self.ops[op]
        entry.calls += 1
        entry.bytes += num_bytes
        entry.seconds += seconds

    @property
    def total_bytes(self) -> int:
        return sum(entry.bytes for entry in self.ops.values())

    def take(self) -> dict[str, OpStats]:
        taken = dict(self.ops)
        self.ops = defaultdict(OpStats)
        return taken
