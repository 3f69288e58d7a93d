"""Rowwise expert-parallel exchange (`parallel.ep_dispatch: rowwise`): rows land where the experts read them.

The permuted exchange sends each rank one block of rows, which arrive grouped by the rank they came from, and
then copies them into expert order for the grouped GEMM (and the outputs back): two copies of every routed row
per layer, and again in the backward. Here the sender sorts its rows by (local expert, destination rank), the
order `expert_order` gives, and the exchange runs once per local expert: expert e's rows for every rank are one
contiguous slice on the sender, and they arrive, by source rank, into expert e's contiguous slice of the
receiver's expert-major buffer, which the grouped GEMM reads as it is. The combine sends the outputs back from
the same slices. No permutation copy is made; the price is `num_local` exchanges of smaller messages instead
of one (each an all-to-all with uneven splits, which every backend has).

Under activation checkpointing the buffers come back as an `aten.alias`, which the recompute keeps with the
collectives (`ferry/kernels/recompute_policy.py`).
"""

from __future__ import annotations

import torch

from ferry.comm import Collectives


def expert_order(expert_ids_TK: torch.Tensor, ranks: int, local: int) -> torch.Tensor:
    """Each global expert's place when rows are sorted by (local expert, owning rank): expert p * L + e goes to
    e * P + p, so sorting by it puts every rank's rows of one local expert side by side."""
    return (expert_ids_TK % local) * ranks + torch.div(expert_ids_TK, local, rounding_mode="floor")


class RowLayout:
    """The rows of each (rank, local expert) pair: `sent_PL[p][e]` this rank sends rank p for its expert e,
    `received_PL[p][e]` it receives from rank p for its own expert e; both sides store them expert-major."""

    def __init__(self, sent_PL: list[list[int]], received_PL: list[list[int]]):
        local = len(sent_PL[0])
        self.sent_EP = [[row[e] for row in sent_PL] for e in range(local)]
        self.received_EP = [[row[e] for row in received_PL] for e in range(local)]
        self.sent_rows = sum(map(sum, self.sent_EP))
        self.received_rows = sum(map(sum, self.received_EP))


def exchange(collectives: Collectives, x_ND: torch.Tensor, layout: RowLayout, op: str, reverse: bool = False):
    """The dispatch (`reverse` False: the sender's rows to the receiver's expert-major buffer) or the combine
    (`reverse` True: back), differentiable: the backward is the other direction."""
    return _Exchange.apply(x_ND, collectives, layout, op, reverse)


def _run(collectives: Collectives, source: torch.Tensor, layout: RowLayout, op: str, reverse: bool) -> torch.Tensor:
    reads, writes = (layout.received_EP, layout.sent_EP) if reverse else (layout.sent_EP, layout.received_EP)
    target = source.new_empty((sum(map(sum, writes)), *source.shape[1:]))
    read_at = write_at = 0
    for read_P, write_P in zip(reads, writes):
        read_rows, write_rows = sum(read_P), sum(write_P)
        collectives.all_to_all_into(
            target[write_at : write_at + write_rows], source[read_at : read_at + read_rows], write_P, read_P, op
        )
        read_at, write_at = read_at + read_rows, write_at + write_rows
    return torch.ops.aten.alias(target)


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, collectives, layout, op, reverse):
        ctx.collectives, ctx.layout, ctx.op, ctx.reverse = collectives, layout, op, reverse
        return _run(collectives, x_ND.contiguous(), layout, op, reverse)

    @staticmethod
    def backward(ctx, grad):
        back = _run(ctx.collectives, grad.contiguous(), ctx.layout, f"{ctx.op}_backward", not ctx.reverse)
        return back, None, None, None, None
