"""An all-to-all issued now and waited for later, so that computation runs while the rows travel.

`start_all_to_all` issues the exchange asynchronously and returns at once; the rows may be read only after
`wait()`. Between the two the rank computes (the experts of another chunk): that is the overlap. The stats
separate the two times that matter: how long the exchange was in flight (`CommStats`, issue to completion; on a
CPU the completion is the moment gloo's worker finished it, on a GPU the moment the compute stream may read the
rows) and how long the rank was blocked waiting for it (the `ep_wait` timer region around `wait()`). The share
of the first that the second does not cover is the overlapped share of the step record.

Both ends are autograd functions: the backward sends the gradients back the way the rows came, synchronously.
Under activation checkpointing the wait returns an `aten.alias` of the received rows, kept by the recompute
policy like the synchronous exchange's (`ferry/kernels/recompute_policy.py`).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ferry.comm.replay import replaying


class PendingAllToAll:
    """One exchange in flight: its output buffer, its work handle and when it was issued and completed."""

    def __init__(self, collectives, out_splits: list[int], in_splits: list[int], op: str):
        self.collectives = collectives
        self.splits = (out_splits, in_splits)
        self.op = op
        self.out: torch.Tensor | None = None
        self.work = None
        self.sent: dict[str, int] = {}
        self.issued = 0.0
        self.completed: list[float] = []
        self.start_event = None

    def issue(self, x_RX: torch.Tensor) -> torch.Tensor:
        out_splits, in_splits = self.splits
        self.out = x_RX.new_empty((sum(out_splits), *x_RX.shape[1:]))
        self.sent = self.collectives.sent(x_RX, in_splits)
        if self.collectives.device.type == "cuda":
            self.start_event = torch.cuda.Event(enable_timing=True)
            self.start_event.record()
        self.issued = time.perf_counter()
        self.work = dist.all_to_all_single(
            self.out, x_RX.contiguous(), out_splits, in_splits, group=self.collectives.group, async_op=True
        )
        if self.collectives.device.type != "cuda":
            self.work.get_future().then(lambda _: self.completed.append(time.perf_counter()))
        return self.out

    def wait(self) -> torch.Tensor:
        """The received rows; the time blocked here is the exposed part of the exchange."""
        return _WaitAllToAll.apply(self.out, self)

    def complete(self) -> None:
        collectives = self.collectives
        with collectives.region("ep_wait"), collectives.blocked(self.op):
            self.work.wait()
        if replaying():
            return
        if self.start_event is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            collectives.defer(self.op, self.sent, self.start_event, end)
            return
        finished = self.completed[0] if self.completed else time.perf_counter()
        collectives.record(self.op, self.sent, finished - self.issued)


def start_all_to_all(
    collectives, x_RX: torch.Tensor, out_splits: list[int], in_splits: list[int], op: str
) -> PendingAllToAll:
    """Issue the exchange of `x_RX`'s rows (`in_splits` to each rank, `out_splits` from each) and return at once."""
    pending = PendingAllToAll(collectives, out_splits, in_splits, op)
    pending.out = _StartAllToAll.apply(x_RX, pending)  # the buffer, now with its place in the autograd graph
    return pending


class _StartAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RX, pending: PendingAllToAll):
        ctx.pending = pending
        return pending.issue(x_RX)

    @staticmethod
    def backward(ctx, grad_RX):
        pending = ctx.pending
        out_splits, in_splits = pending.splits
        grad = pending.collectives.all_to_all_raw(grad_RX.contiguous(), in_splits, out_splits, f"{pending.op}_backward")
        return grad, None


class _WaitAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out_RX, pending: PendingAllToAll):
        pending.complete()
        return torch.ops.aten.alias(out_RX)

    @staticmethod
    def backward(ctx, grad_RX):
        return grad_RX, None
