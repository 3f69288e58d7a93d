"""`optim.zero: true`: ZeRO-1 over the expert-resident placement (`ferry/parallel/zero.py`). Every piece of optimizer
state has one owner among the ranks replicating it, which steps it and broadcasts the updated rows to the others:
the optimizer state per rank falls by the replica count, at the cost of a broadcast of every parameter a step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from ferry.train.layouts.base import LayoutKind, MemoryTerms, Traffic
from ferry.train.layouts.sizes import param_bytes, param_counts

if TYPE_CHECKING:
    from ferry.parallel.layout import JobLayout


class ZeroOne(LayoutKind):
    name: ClassVar[str] = "zero-1"

    def active(self, config: Any) -> bool:
        return config.optim.zero

    def memory(self, config: Any, layout: JobLayout, terms: MemoryTerms) -> MemoryTerms:
        """Dense state split over all the replicas, expert state over the ranks holding the same experts."""
        share, ranks, ep = terms.share, terms.world_size, terms.experts_split_over
        dense = share.total_params - share.expert_params
        holders = max(ranks // ep, 1)
        return terms.with_(moments=dense / ranks + share.expert_params / ep / holders)

    def traffic(self, config: Any, layout: JobLayout, micro_batch: int) -> list[Traffic]:
        """After the step each owner broadcasts its updated rows: every rank receives (or sends) each parameter it
        holds once, dense ones over the replicas, expert ones over the ranks holding the same experts."""
        counts, ep = param_counts(config), config.parallel.ep
        traffic = []
        dense = (counts.total - counts.experts) / layout.pp * param_bytes(config)
        if layout.replicas > 1:
            traffic.append(Traffic("broadcast", layout.replicas, dense / layout.replicas, "replicas", layout.replicas))
        holders = layout.replicas // ep
        if holders > 1 and counts.experts:
            experts = counts.experts / ep / layout.pp * param_bytes(config)
            traffic.append(Traffic("broadcast", holders, experts / holders, "dp", holders))
        return traffic
