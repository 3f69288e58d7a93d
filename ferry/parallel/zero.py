"""ZeRO-1: AdamW (or Muon with AdamW) whose state is sharded over the ranks that replicate the parameters.

Every parameter is owned by one rank of its replica group (greedy by size, in
name order, so every rank computes the same assignment). A rank keeps Adam moments
(or Muon's momentum) only for what it owns, updates only that, then each owner broadcasts its updated
parameters to the group. AdamW is elementwise and Muon works on whole matrices, which an owner holds whole, so
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


@dataclass
class ReplicaGroup:
    """Parameters replicated over the ranks of `collectives` (None: not replicated, this rank owns all)."""

    params: list[tuple[str, nn.Parameter]]
    collectives: Collectives | None


class ShardedAdamW:
    """The `torch.optim.Optimizer` surface the trainer uses, over owner-partitioned parameters."""

    def __init__(
        self,
        groups: list[ReplicaGroup],
        decayed: set[str],
        weight_decay: float,
        muon: MuonSettings | None = None,
        **adamw_kwargs,
    ):
        self.groups = groups
        self.owner: dict[str, int] = {}
        owned: list[tuple[str, nn.Parameter]] = []
        for group in groups:
            size = group.collectives.size if group.collectives is not None else 1
            rank = group.collectives.rank if group.collectives is not None else 0
            for name, owner in _assign_owners(group.params, size).items():
                self.owner[name] = owner
            owned += [(name, p) for name, p in group.params if self.owner[name] == rank]
        self.owned_names = [name for name, _ in owned]
        self.local = optimizer_over(owned, decayed, weight_decay, muon, **adamw_kwargs)

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
        self.local.step()
        for group in self.groups:
            if group.collectives is None or group.collectives.size == 1:
                continue
            for owner in range(group.collectives.size):
                tensors = [p.data for name, p in group.params if self.owner[name] == owner]
                if not tensors:
                    continue
                flat = _flatten_dense_tensors(tensors)
                group.collectives.broadcast(flat, group_src=owner)
                for tensor, synced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                    tensor.copy_(synced)

    def state_bytes(self) -> int:
        """Bytes of optimizer state held on this rank (the ZeRO-1 saving shows here)."""
        return optimizer_state_bytes(self.local)


def _assign_owners(params: list[tuple[str, nn.Parameter]], size: int) -> dict[str, int]:
    """Largest-first greedy balance of parameter sizes over `size` ranks; ties to the lower rank."""
    load = [0] * size
    owners: dict[str, int] = {}
    for name, param in sorted(params, key=lambda item: -item[1].numel()):
        owner = min(range(size), key=lambda rank: (load[rank], rank))
        owners[name] = owner
        load[owner] += param.numel()
    return owners


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of tensors in an optimizer's state on this rank (ZeRO-1's `state` is its own shard)."""
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if torch.is_tensor(value)
    )
