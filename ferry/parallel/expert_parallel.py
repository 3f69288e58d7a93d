"""Expert parallelism: experts stay resident on their EP rank and tokens travel to them.

Each EP rank holds `num_experts / ep` consecutive experts. A MoE layer's dispatcher
exchanges per-expert counts, sends every routed token to the rank owning its
expert (all-to-all), runs the local experts as grouped GEMMs on contiguous groups,
and returns the results by a second all-to-all; the layer then combines as on one
device. Only activations move; expert weights never leave their rank.
"""

from __future__ import annotations

import torch
from torch import nn

from ferry.comm import Collectives


class AllToAllDispatcher:
    """Runs the routed tokens of one MoE layer through experts spread over an EP group."""

    def __init__(self, collectives: Collectives, num_experts: int):
        self.collectives = collectives
        self.ep_size = collectives.size
        self.num_local = num_experts // self.ep_size

    @torch.compiler.disable
    def __call__(self, x_ND: torch.Tensor, tokens_per_expert_E: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        """`x_ND` is sorted by global expert id; returns expert outputs in the same order.

        Its one host read is the exchange of the per-rank row counts that the all-to-all needs for
        its split sizes; a compiled block runs it eagerly (a graph break) for the same reason.
        """
        with self.collectives.region("ep_wait"):
            received_counts_PL, send_splits, receive_splits, x_RD = self._dispatch(x_ND, tokens_per_expert_E)
        y_RD = self._run_local_experts(x_RD, received_counts_PL, experts)
        with self.collectives.region("ep_wait"):
            return self.collectives.all_to_all(y_RD, send_splits, receive_splits, op="ep_combine")

    def _dispatch(self, x_ND: torch.Tensor, tokens_per_expert_E: torch.Tensor):
        """Exchange per-expert counts, then send each token to the rank holding its expert."""
        ep, local = self.ep_size, self.num_local
        received_counts = self.collectives.all_to_all_raw(tokens_per_expert_E, None, None, op="ep_counts")
        received_counts_PL = received_counts.view(ep, local)
        send_splits = tokens_per_expert_E.view(ep, local).sum(1).tolist()
        receive_splits = received_counts_PL.sum(1).tolist()
        x_RD = self.collectives.all_to_all(x_ND, receive_splits, send_splits, op="ep_dispatch")
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


def shard_experts(experts: nn.Module, ep_rank: int, ep_size: int) -> tuple[int, int]:
    """Keep only this rank's slice [start, stop) of every expert tensor (dim 0); returns the slice."""
    tensors = dict(experts.named_parameters(recurse=False))
    num_experts = next(iter(tensors.values())).shape[0]
    local = num_experts // ep_size
    start, stop = ep_rank * local, (ep_rank + 1) * local
    for name, param in tensors.items():
        setattr(experts, name, nn.Parameter(param.detach()[start:stop].clone(), requires_grad=param.requires_grad))
    return start, stop
