"""Time and bytes spent in collectives, per operation: the raw material of comm/compute metrics."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

LINK_TIERS = ("intra_node", "inter_node")


@dataclass
class OpStats:
    """One op's calls, bytes and seconds in a step, and of them what each link tier carried: `tier_bytes` the bytes
    sent to ranks over it (none for a rank's rows to itself), `tier_seconds` the time of the calls whose widest link
    it was."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0
    tier_bytes: dict[str, int] = field(default_factory=dict)
    tier_seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class CommStats:
    """Accumulates per-op figures until `take()` hands them to the step's metrics and starts afresh."""

    ops: dict[str, OpStats] = field(default_factory=lambda: defaultdict(OpStats))

    def record(
        self, op: str, num_bytes: int, seconds: float, tier_bytes: dict[str, int] | None = None, tier: str | None = None
    ) -> None:
        entry = self.ops[op]
        entry.calls += 1
        entry.bytes += num_bytes
        entry.seconds += seconds
        for name, sent in (tier_bytes or {}).items():
            entry.tier_bytes[name] = entry.tier_bytes.get(name, 0) + sent
        if tier is not None:
            entry.tier_seconds[tier] = entry.tier_seconds.get(tier, 0.0) + seconds

    @property
    def total_bytes(self) -> int:
        return sum(entry.bytes for entry in self.ops.values())

    def take(self) -> dict[str, OpStats]:
        taken = dict(self.ops)
        self.ops = defaultdict(OpStats)
        return taken


def tier_figures(ops: dict[str, OpStats]) -> dict[str, float]:
    """A step's bytes and seconds per link tier (`intra_node_bytes`, `inter_node_comm_s`, ...) from `take()`'s
    ops."""
    figures: dict[str, float] = {}
    for tier in LINK_TIERS:
        figures[f"{tier}_bytes"] = sum(entry.tier_bytes.get(tier, 0) for entry in ops.values())
        figures[f"{tier}_comm_s"] = sum(entry.tier_seconds.get(tier, 0.0) for entry in ops.values())
    return figures
