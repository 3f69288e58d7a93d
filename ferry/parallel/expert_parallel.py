"""Expert parallelism: experts stay resident on their EP rank and tokens travel to them.

Each EP rank holds `num_experts / ep` consecutive experts. A MoE layer's dispatcher
exchanges per-expert counts, sends every routed token to the rank owning its
expert (all-to-all), runs the local experts as grouped GEMMs on contiguous groups,
and returns the results by a second all-to-all; the layer then combines as on one
device. Only activations move; expert weights never leave their rank.

With `parallel.ep_overlap: chunked` each expert's rows travel in `ep_chunks` parts, each
exchange issued asynchronously (`ferry/comm/pending.py`): while the local experts compute
part k, part k+1's dispatch and part k-1's combine are in flight. It costs a gather of
the rows into parts and a scatter of the outputs back, and more, smaller messages; the
step record's `ep_overlap_share` and benchmarks/ep_overlap.py say whether it pays.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ferry.comm import Collectives
from ferry.comm.pending import start_all_to_all
from ferry.model.moe import RowDispatcher
from ferry.parallel.rowwise import RowLayout, exchange, expert_order

# a forward's exchanges, the ep_wait region's: the flat exchange's, and the hierarchical one's routes and its
# forwarding inside the node (`ferry/parallel/hierarchical.py`)
EP_EXCHANGES = (
    "ep_counts",
    "ep_dispatch",
    "ep_combine",
    "ep_routes",
    "ep_node_counts",
    "ep_node_dispatch",
    "ep_node_combine",
)


class AllToAllDispatcher(RowDispatcher):
    """Runs the routed rows of one MoE layer through experts spread over an EP group: in one exchange each way,
    or (`chunks` > 1) in parts whose exchanges are in flight while the experts compute another part. `stage` names
    its exchanges in the stats (`ep`: `ep_counts`, `ep_dispatch`, `ep_combine`; the hierarchical exchange's
    forwarding inside a node is `ep_node`)."""

    def __init__(
        self, collectives: Collectives, num_experts: int, chunks: int = 1, rowwise: bool = False, stage: str = "ep"
    ):
        self.collectives = collectives
        self.ep_size = collectives.size
        self.num_local = num_experts // self.ep_size
        self.chunks = chunks
        self.rowwise = rowwise
        self.ops = (f"{stage}_counts", f"{stage}_dispatch", f"{stage}_combine")

    @torch.compiler.disable
    def rows(self, x_ND: torch.Tensor, tokens_per_expert_E: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        """`x_ND` is sorted by global expert id; returns expert outputs in the same order.

        Its one host read is the exchange of the per-rank row counts that the all-to-all needs for
        its split sizes; a compiled block runs it eagerly (a graph break) for the same reason.
        """
        if self.rowwise:
            return self._rowwise(x_ND, tokens_per_expert_E, experts)
        if self.chunks > 1:
            return self._chunked(x_ND, tokens_per_expert_E, experts)()
        with self.collectives.region("ep_wait"):
            received_counts_PL, send_splits, receive_splits, x_RD = self._dispatch(x_ND, tokens_per_expert_E)
        y_RD = self._run_local_experts(x_RD, received_counts_PL, experts)
        with self.collectives.region("ep_wait"):
            return self.collectives.all_to_all(y_RD, send_splits, receive_splits, op=self.ops[2])

    @torch.compiler.disable
    def start_rows(
        self, x_ND: torch.Tensor, tokens_per_expert_E: torch.Tensor, experts: nn.Module
    ) -> Callable[[], torch.Tensor]:
        """As `rows`, but the combine exchange is issued asynchronously and left in flight: the returned function
        waits for it (`model.skip: farskip` runs the next block's attention in between). The rowwise exchange
        goes per local expert in one piece, so it returns its outputs already arrived."""
        if self.rowwise:
            y_ND = self._rowwise(x_ND, tokens_per_expert_E, experts)
            return lambda: y_ND
        if self.chunks > 1:
            return self._chunked(x_ND, tokens_per_expert_E, experts)
        with self.collectives.region("ep_wait"):
            received_counts_PL, send_splits, receive_splits, x_RD = self._dispatch(x_ND, tokens_per_expert_E)
        y_RD = self._run_local_experts(x_RD, received_counts_PL, experts)
        return start_all_to_all(self.collectives, y_RD, send_splits, receive_splits, self.ops[2]).wait

    def expert_order(self, expert_ids_TK: torch.Tensor) -> torch.Tensor:
        """What the assignments are sorted by before they travel: the global expert, or for the rowwise exchange
        (local expert, owning rank)."""
        return expert_order(expert_ids_TK, self.ep_size, self.num_local) if self.rowwise else expert_ids_TK

    def _rowwise(self, x_ND: torch.Tensor, tokens_per_expert_E: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        """`x_ND` sorted by (local expert, rank): the exchange once per local expert, each row received straight
        into the experts' expert-major input and each output sent back from it (`ferry/parallel/rowwise.py`), no
        permutation copy either way; the outputs come back in `x_ND`'s order."""
        ep, local = self.ep_size, self.num_local
        with self.collectives.region("ep_wait"):
            received = self.collectives.all_to_all_raw(tokens_per_expert_E, None, None, op=self.ops[0])
            received_PL = received.view(ep, local)
            layout = RowLayout(tokens_per_expert_E.view(ep, local).tolist(), received_PL.tolist())
            x_RD = exchange(self.collectives, x_ND, layout, self.ops[1])
        y_RD = experts(x_RD, received_PL.sum(0))
        with self.collectives.region("ep_wait"):
            return exchange(self.collectives, y_RD, layout, self.ops[2], reverse=True)

    def _chunked(
        self, x_ND: torch.Tensor, tokens_per_expert_E: torch.Tensor, experts: nn.Module
    ) -> Callable[[], torch.Tensor]:
        """Each expert's rows split into `chunks` parts (part k: its k-th share, in order); part k+1's dispatch and
        part k's combine are in flight while the experts compute part k. One exchange of the counts of every
        part, one host read of them; then per part an asynchronous dispatch, the local experts, an asynchronous
        combine; the returned function waits for the combines and puts the parts' outputs back in the rows'
        order. The rows an expert computes are the same, in parts: equal to the unchunked result but for the
        float rounding of the weight gradients, summed over the parts."""
        ep, local, chunks = self.ep_size, self.num_local, self.chunks
        counts_KE, rows_K = _chunk_rows(tokens_per_expert_E, chunks)
        with self.collectives.region("ep_wait"):
            received_KPL = self.collectives.all_to_all_raw(
                counts_KE.view(chunks, ep, local).transpose(0, 1).contiguous(), None, None, op=self.ops[0]
            ).transpose(0, 1)
        send_KP = counts_KE.view(chunks, ep, local).sum(2).tolist()
        receive_KP = received_KPL.sum(2).tolist()
        dispatches = [None] * chunks
        dispatches[0] = start_all_to_all(
            self.collectives, x_ND.index_select(0, rows_K[0]), receive_KP[0], send_KP[0], self.ops[1]
        )
        combines = []
        for part in range(chunks):
            if part + 1 < chunks:
                dispatches[part + 1] = start_all_to_all(
                    self.collectives,
                    x_ND.index_select(0, rows_K[part + 1]),
                    receive_KP[part + 1],
                    send_KP[part + 1],
                    self.ops[1],
                )
            y_RD = self._run_local_experts(dispatches[part].wait(), received_KPL[part], experts)
            combines.append(start_all_to_all(self.collectives, y_RD, send_KP[part], receive_KP[part], self.ops[2]))
        order_N = torch.cat(rows_K)
        inverse_N = torch.empty_like(order_N)
        inverse_N[order_N] = torch.arange(order_N.numel(), device=order_N.device)

        def arrive() -> torch.Tensor:
            return torch.cat([combine.wait() for combine in combines]).index_select(0, inverse_N)

        return arrive

    def _dispatch(self, x_ND: torch.Tensor, tokens_per_expert_E: torch.Tensor):
        """Exchange per-expert counts, then send each token to the rank holding its expert."""
        ep, local = self.ep_size, self.num_local
        received_counts = self.collectives.all_to_all_raw(tokens_per_expert_E, None, None, op=self.ops[0])
        received_counts_PL = received_counts.view(ep, local)
        send_splits = tokens_per_expert_E.view(ep, local).sum(1).tolist()
        receive_splits = received_counts_PL.sum(1).tolist()
        x_RD = self.collectives.all_to_all(x_ND, receive_splits, send_splits, op=self.ops[1])
        return received_counts_PL, send_splits, receive_splits, x_RD

    def _run_local_experts(self, x_RD: torch.Tensor, received_counts_PL: torch.Tensor, experts: nn.Module):
        """Received rows come grouped by source rank, then by local expert: regroup by expert, run, restore."""
        ep, local = self.ep_size, self.num_local
        expert_of_row_R = torch.repeat_interleave(
            torch.arange(local, device=x_RD.device).repeat(ep), received_counts_PL.flatten(), output_size=len(x_RD)
        )
        order_R = torch.argsort(expert_of_row_R, stable=True)
        y_sorted_RD = experts(x_RD.index_select(0, order_R), received_counts_PL.sum(0))
        inverse_R = torch.empty_like(order_R)
        inverse_R[order_R] = torch.arange(order_R.numel(), device=order_R.device)
        return y_sorted_RD.index_select(0, inverse_R)


def _chunk_rows(tokens_per_expert_E: torch.Tensor, chunks: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Per part, the rows it takes of every expert (counts [chunks, E]) and their indices in the expert-sorted rows:
    part k takes rows [floor(k n_e / chunks), floor((k+1) n_e / chunks)) of expert e's n_e."""
    n_E = tokens_per_expert_E.to(torch.int64)
    starts_E = torch.cumsum(n_E, 0) - n_E
    parts_K1 = torch.arange(chunks + 1, device=n_E.device)[:, None]
    bounds_KE = torch.div(parts_K1 * n_E, chunks, rounding_mode="floor")
    counts_KE = bounds_KE[1:] - bounds_KE[:-1]
    rows_K = []
    for part in range(chunks):
        counts_E = counts_KE[part]
        first_E = starts_E + bounds_KE[part]
        total = int(counts_E.sum())
        offsets_E = torch.cumsum(counts_E, 0) - counts_E
        offset_M = torch.repeat_interleave(offsets_E, counts_E, output_size=total)
        within_M = torch.arange(total, device=n_E.device) - offset_M
        rows_K.append(torch.repeat_interleave(first_E, counts_E, output_size=total) + within_M)
    return counts_KE, rows_K


def shard_experts(experts: nn.Module, ep_rank: int, ep_size: int) -> tuple[int, int]:
    """Keep only this rank's slice [start, stop) of every expert tensor (dim 0); returns the slice."""
    tensors = dict(experts.named_parameters(recurse=False))
    num_experts = next(iter(tensors.values())).shape[0]
    local = num_experts // ep_size
    start, stop = ep_rank * local, (ep_rank + 1) * local
    for name, param in tensors.items():
        setattr(experts, name, nn.Parameter(param.detach()[start:stop].clone(), requires_grad=param.requires_grad))
    return start, stop
