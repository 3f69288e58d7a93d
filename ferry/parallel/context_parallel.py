"""Context parallelism (`parallel.cp`): the ranks of a group each hold 1/N of every sequence, and attention gathers
the keys and values of the whole sequence from them.

The split itself (which positions a rank keeps, what its queries see) is the model's (`ferry.model.sequence_split`);
here is the exchange it runs on, one group's collectives, each a named op in the step's communication figures:

    cp_gather             every rank's keys and values (GQA), or latents and rotary keys (MLA), per attention layer
    cp_gather_backward    their gradients, reduce-scattered back to the ranks whose positions made them
    cp_sum                the routers' loads and counts, and the row sums a loss needs whole (DPO's log-probs)

All-gathering keys and values (as Llama 3 trained) rather than passing them round a ring or exchanging heads
(Ulysses), chosen against both on two CPU ranks (docs/performance.md, `benchmarks/context_parallel.py`): Ulysses'
four all-to-alls took the longest; a ring pass moves the same bytes faster on gloo, but the whole exchange is 5-8%
of the step, the most a ring could hide, for N - 1 partial attentions merged by their softmax statistics under
blocks of the document mask. The all-gather keeps one masked attention through the kernel boundary, any mask a
document boundary makes, and asks nothing of the head counts (GQA's few key heads; MLA's latents, gathered instead
of every head's keys). It keeps the whole sequence's keys for the backward, which the memory model counts: at cp 2
a rank keeps 0.50-0.51 of what one process keeps.
"""

from __future__ import annotations

import torch

from ferry.comm import Collectives, OpStats
from ferry.model.sequence_split import SequenceSplit

CONTEXT_EXCHANGES = ("cp_gather", "cp_gather_backward", "cp_sum")


class ContextExchange:
    """`SequenceExchange` over one context-parallel group."""

    def __init__(self, collectives: Collectives):
        self.collectives = collectives

    def gather(self, x_BXLW: torch.Tensor, dim: int) -> torch.Tensor:
        return _Gather.apply(x_BXLW, dim, self.collectives)

    def sum_parts(self, x: torch.Tensor) -> torch.Tensor:
        return _SumParts.apply(x, self.collectives)

    def total(self, x: torch.Tensor) -> torch.Tensor:
        return self.collectives.all_reduce_raw(x, "cp_sum")


def exchange_figures(exchanged: dict[str, OpStats]) -> dict:
    """The step record's context-parallel figures from its collectives' (this rank's): seconds and bytes."""
    ops = [exchanged[op] for op in CONTEXT_EXCHANGES if op in exchanged]
    return {"cp.comm_s": sum(op.seconds for op in ops), "cp.bytes": sum(op.bytes for op in ops)}


def sequence_split(collectives: Collectives) -> SequenceSplit:
    """This rank's split of every sequence over its context-parallel group."""
    return SequenceSplit(collectives.rank, collectives.size, ContextExchange(collectives))


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BXLW, dim, collectives: Collectives):
        ctx.dim, ctx.collectives = dim, collectives
        stacked_NBXLW = collectives.all_gather_raw(x_BXLW, "cp_gather")
        return stacked_NBXLW.movedim(0, dim).flatten(dim, dim + 1)

    @staticmethod
    def backward(ctx, grad_BXSW):
        dim, collectives = ctx.dim, ctx.collectives
        grad_NBXLW = grad_BXSW.unflatten(dim, (collectives.size, -1)).movedim(dim, 0).contiguous()
        grad_BXLW = grad_NBXLW.new_empty(grad_NBXLW.shape[1:])
        collectives.reduce_scatter(grad_BXLW, grad_NBXLW.flatten(0, 1), "cp_gather_backward")  # joined, as gloo asks
        return grad_BXLW, None, None


class _SumParts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, part, collectives: Collectives):
        return collectives.all_reduce_raw(part, "cp_sum")

    @staticmethod
    def backward(ctx, grad_whole):
        return grad_whole, None
