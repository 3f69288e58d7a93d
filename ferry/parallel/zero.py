"""ZeRO-1: AdamW (or Muon with AdamW) whose state is sharded over the ranks that replicate the parameters.

Every piece of optimizer state has one owner among the ranks of its replica group: a matrix or vector whole, a
stack of expert matrices split by matrix (`ferry/parallel/ownership.py`: consecutive runs balanced by size, in
model order, so every rank computes the same assignment and the ranks finish together). A rank keeps Adam moments
(or Muon's momentum) only for what it owns, updates only that, then each owner broadcasts its updated
rows to the group. AdamW is elementwise and Muon works on whole matrices, which an owner holds whole, so
the result equals the unsharded optimizer's; the optimizer memory per rank falls by the group size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ferry.comm import Collectives
from ferry.parallel.muon import MuonSettings
from ferry.parallel.optimizers import optimizer_over
from ferry.parallel.ownership import ParamSlice, slices_by_owner


@dataclass
class ReplicaGroup:
    """Parameters replicated over the ranks of `collectives` (None: not replicated, this rank owns all)."""

    params: list[tuple[str, nn.Parameter]]
    collectives: Collectives | None


class ShardedOptimizer:
    """The `torch.optim.Optimizer` surface the trainer uses, over owner-partitioned parameter slices."""

    def __init__(
        self,
        groups: list[ReplicaGroup],
        decayed: set[str],
        weight_decay: float,
        muon: MuonSettings | None = None,
        **adamw_kwargs,
    ):
        self.groups = groups
        self.slices: list[list[list[ParamSlice]]] = []  # per group, per rank of the group
        self.owned: list[ParamSlice] = []
        for group in groups:
            size = group.collectives.size if group.collectives is not None else 1
            rank = group.collectives.rank if group.collectives is not None else 0
            by_owner = slices_by_owner(group.params, size)
            self.slices.append(by_owner)
            self.owned += by_owner[rank]
        self.local = optimizer_over(
            [(piece.name, piece.tensor) for piece in self.owned], decayed, weight_decay, muon, **adamw_kwargs
        )

    @property
    def param_groups(self):
        return self.local.param_groups

    @property
    def state(self):
        return self.local.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.groups:
            for _, param in group.params:
                param.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for piece in self.owned:
            piece.take_gradient()
        self.local.step()
        for piece in self.owned:
            if not piece.whole:
                piece.tensor.grad = None
        for group, by_owner in zip(self.groups, self.slices, strict=True):
            if group.collectives is None or group.collectives.size == 1:
                continue
            for owner, pieces in enumerate(by_owner):
                if not pieces:
                    continue
                tensors = [piece.param.data[piece.start : piece.stop] for piece in pieces]
                flat = _flatten_dense_tensors(tensors)
                group.collectives.broadcast(flat, group_src=owner)
                for tensor, synced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                    tensor.copy_(synced)

    def state_bytes(self) -> int:
        """Bytes of optimizer state held on this rank (the ZeRO-1 saving shows here)."""
        return optimizer_state_bytes(self.local)


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of tensors in an optimizer's state on this rank (ZeRO-1's `state` is its own shard)."""
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if torch.is_tensor(value)
    )
