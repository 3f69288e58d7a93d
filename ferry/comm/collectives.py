"""The one interface every expert-parallel and data-parallel collective goes through.

Keeping the calls in one place lets the backend be swapped by configuration and
makes every byte and second of communication visible to the metrics: each call
records its time (CUDA events on GPUs, wall clock on CPUs) and the bytes it sent, and
which link tier carried them. A group knows where its ranks sit (`node_size`: consecutive
ranks share a node): an all-to-all's rows to a rank of this node go over the node's links,
to another node's over the network, to this rank itself over none; another collective's
bytes, and every call's time, count in the widest tier its group spans.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from ferry.comm.replay import replaying
from ferry.comm.stats import CommStats


def newest_collective(module, current: str, former: str):
    """`module.current` where this torch has it, else `module.former`: torch 2.13 renamed the tensor forms of
    reduce-scatter and all-gather (`*_single`) and warns on every call of the old names, which torch 2.11 (still
    run on accelerators) alone has."""
    return getattr(module, current, None) or getattr(module, former)


_reduce_scatter = newest_collective(dist, "reduce_scatter_single", "reduce_scatter_tensor")
_all_gather = newest_collective(dist, "all_gather_single", "all_gather_into_tensor")


class Collectives:
    """Collectives over one process group (None = the default group), timed into `stats`."""

    def __init__(
        self, group: dist.ProcessGroup | None, stats: CommStats, device: torch.device, node_size: int | None = None
    ):
        self.group = group
        self.stats = stats
        self.device = device
        self.timer = None
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._pending: list[tuple[str, dict[str, int], torch.cuda.Event, torch.cuda.Event]] = []
        members = dist.get_process_group_ranks(group) if group is not None else list(range(self.size))
        node = node_size or dist.get_world_size()
        mine = members[self.rank] // node
        self.peer_tiers = tuple(
            None if peer == members[self.rank] else "intra_node" if peer // node == mine else "inter_node"
            for peer in members
        )
        spanned = [tier for tier in self.peer_tiers if tier is not None]
        self.tier = "inter_node" if "inter_node" in spanned else "intra_node" if spanned else None

    def group_rank_to_global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def all_to_all(
        self, x_RX: torch.Tensor, out_splits: list[int], in_splits: list[int], op: str = "all_to_all"
    ) -> torch.Tensor:
        """Differentiable all-to-all of rows: backward sends the gradients back the way they came.

        `op` names the call in the stats (e.g. `ep_dispatch`); its backward is `<op>_backward`.
        """
        return _AllToAll.apply(x_RX, out_splits, in_splits, self, op)

    def all_to_all_raw(
        self, x_RX: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None, op: str = "all_to_all"
    ) -> torch.Tensor:
        """The rows exchanged, as an `aten.alias` of the buffer the collective wrote: activation checkpointing
        keeps that alias (`ferry/model/recompute.py`), so a recompute reads the first exchange's rows while the
        collective itself, kept too, is not issued again and not counted twice."""
        rows_out = sum(out_splits) if out_splits is not None else x_RX.shape[0]
        out = x_RX.new_empty((rows_out, *x_RX.shape[1:]))
        with self._timed_once(op, self.sent(x_RX, in_splits)):
            dist.all_to_all_single(out, x_RX.contiguous(), out_splits, in_splits, group=self.group)
        return torch.ops.aten.alias(out)

    def all_to_all_into(
        self, out_RX: torch.Tensor, x_RX: torch.Tensor, out_splits: list[int], in_splits: list[int], op: str
    ) -> None:
        """The all-to-all of rows written into `out_RX`, a slice of a larger buffer (`ferry/parallel/rowwise.py`).
        Not counted again when a recompute replays it."""
        with self._timed_once(op, self.sent(x_RX, in_splits)):
            dist.all_to_all_single(out_RX, x_RX, out_splits, in_splits, group=self.group)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        with self.timed("all_reduce", tensor.numel() * tensor.element_size()):
            dist.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "reduce_scatter") -> torch.Tensor:
        with self.timed(op, input.numel() * input.element_size()):
            _reduce_scatter(output, input, group=self.group)
        return output

    def all_gather_raw(self, x: torch.Tensor, op: str) -> torch.Tensor:
        """Every rank's `x` stacked in rank order ([size, *x.shape]), as an `aten.alias` of the buffer the collective
        wrote: a recompute reads the first gather's result and issues none (as `all_to_all_raw`)."""
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))  # the first dimension joined, as gloo asks
        with self._timed_once(op, out.numel() * out.element_size()):
            _all_gather(out, x.contiguous(), group=self.group)
        return torch.ops.aten.alias(out).view(self.size, *x.shape)

    def all_reduce_raw(self, x: torch.Tensor, op: str) -> torch.Tensor:
        """The sum of every rank's `x` in a new tensor, as an `aten.alias` a recompute reads again (as
        `all_to_all_raw`)."""
        out = x.detach().clone()
        with self._timed_once(op, out.numel() * out.element_size()):
            dist.all_reduce(out, group=self.group)
        return torch.ops.aten.alias(out)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        with self.timed("all_gather", input.numel() * input.element_size() * self.size):
            _all_gather(output, input.contiguous(), group=self.group)
        return output

    def broadcast(self, tensor: torch.Tensor, group_src: int) -> torch.Tensor:
        with self.timed("broadcast", tensor.numel() * tensor.element_size()):
            dist.broadcast(tensor, src=self.group_rank_to_global(group_src), group=self.group)
        return tensor

    def gather(self, tensor: torch.Tensor, group_dst: int, op: str = "gather") -> list[torch.Tensor] | None:
        """Every rank's `tensor` (all of one shape) on rank `group_dst` of the group, in rank order; None elsewhere."""
        gathered = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == group_dst else None
        with self.timed(op, tensor.numel() * tensor.element_size() * self.size):
            dist.gather(tensor.contiguous(), gathered, dst=self.group_rank_to_global(group_dst), group=self.group)
        return gathered

    def scatter(
        self, output: torch.Tensor, pieces: list[torch.Tensor] | None, group_src: int, op: str = "scatter"
    ) -> torch.Tensor:
        """Rank `group_src`'s `pieces[r]` into rank r's `output` (all of `output`'s shape)."""
        with self.timed(op, output.numel() * output.element_size() * self.size):
            dist.scatter(output, pieces, src=self.group_rank_to_global(group_src), group=self.group)
        return output

    def region(self, name: str):
        """The step timer's region `name` when a timer is attached (comm sits below metrics, so it is handed one)."""
        return self.timer.region(name) if self.timer is not None else nullcontext()

    @contextmanager
    def blocked(self, op: str):
        """Time blocked waiting for an exchange issued earlier (`ferry/comm/pending.py`): the comm region, and the
        collective a hang's report names."""
        with self.region("comm"):
            _WAITING.append(op)
            try:
                yield
            finally:
                _WAITING.pop()

    def sent(self, x_RX: torch.Tensor, in_splits: list[int] | None) -> dict[str, int]:
        """The bytes an all-to-all of `x_RX` sends to each link tier (`in_splits`: rows to each rank; None: equal
        parts), under the key `total` all of them, its own rows included."""
        row_bytes = x_RX[0].numel() * x_RX.element_size() if x_RX.shape[0] else 0
        rows = in_splits if in_splits is not None else [x_RX.shape[0] // self.size] * self.size
        sent = {"total": x_RX.numel() * x_RX.element_size()}
        for tier, count in zip(self.peer_tiers, rows):
            if tier is not None:
                sent[tier] = sent.get(tier, 0) + count * row_bytes
        return sent

    def record(self, op: str, sent: int | dict[str, int], seconds: float) -> None:
        """One call into the stats: its bytes (a count, carried by the group's widest tier; or `sent`'s split) and
        its time (the widest tier's)."""
        if isinstance(sent, int):
            sent = {"total": sent, **({self.tier: sent} if self.tier is not None else {})}
        tiers = {tier: count for tier, count in sent.items() if tier != "total"}
        self.stats.record(op, sent["total"], seconds, tiers, self.tier)

    def defer(self, op: str, sent: int | dict[str, int], start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        """Record an op timed by CUDA events once they have completed (`flush`)."""
        self._pending.append((op, sent, start, end))

    def flush(self) -> None:
        """Resolve CUDA event timings into the stats (call once per step, after a sync point)."""
        for op, sent, start, end in self._pending:
            end.synchronize()
            self.record(op, sent, start.elapsed_time(end) / 1000.0)
        self._pending.clear()

    def _timed_once(self, op: str, sent: int | dict[str, int]):
        """`timed`, except in a recompute's replay: the exchange it reads was counted when it was made."""
        return nullcontext() if replaying() else self.timed(op, sent)

    @contextmanager
    def timed(self, op: str, sent: int | dict[str, int]):
        """Record the time and bytes (`record`'s `sent`) of one collective issued inside the block (also by other
        libraries)."""
        with self.region("comm"):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                yield
                end.record()
                self._pending.append((op, sent, start, end))
                return
            started = time.perf_counter()
            _WAITING.append(op)
            try:
                yield
            finally:
                _WAITING.pop()
            self.record(op, sent, time.perf_counter() - started)


# The host-synchronous collective this process is inside (gloo; a CUDA collective returns at launch): a rank
# stuck there is waiting for a peer, not stuck itself, which is what a hang's report must tell apart.
_WAITING: list[str] = []


def waiting_in() -> str | None:
    """The collective this process is waiting in, if any."""
    return _WAITING[-1] if _WAITING else None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RX, out_splits, in_splits, collectives: Collectives, op: str):
        ctx.collectives = collectives
        ctx.splits = (out_splits, in_splits)
        ctx.op = op
        return collectives.all_to_all_raw(x_RX, out_splits, in_splits, op)

    @staticmethod
    def backward(ctx, grad_RX):
        out_splits, in_splits = ctx.splits
        grad = ctx.collectives.all_to_all_raw(grad_RX.contiguous(), in_splits, out_splits, f"{ctx.op}_backward")
        return grad, None, None, None, None
