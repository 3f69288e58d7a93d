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

from ferry.checkpoint import TensorPiece
from ferry.comm import Collectives
from ferry.parallel.optimizers import OptimizerRecipe
from ferry.parallel.ownership import ParamSlice, slices_by_owner


@dataclass
class ReplicaGroup:
    """Parameters replicated over the ranks of `collectives` (None: not replicated, this rank owns all)."""

    params: list[tuple[str, nn.Parameter]]
    collectives: Collectives | None


class ShardedOptimizer:
    """The `torch.optim.Optimizer` surface the trainer uses, over owner-partitioned parameter slices."""

    def __init__(self, groups: list[ReplicaGroup], recipe: OptimizerRecipe):
        self.groups = groups
        self.slices: list[list[list[ParamSlice]]] = []  # per group, per rank of the group
        self.owned: list[ParamSlice] = []
        for group in groups:
            size = group.collectives.size if group.collectives is not None else 1
            rank = group.collectives.rank if group.collectives is not None else 0
            by_owner = slices_by_owner(group.params, size)
            self.slices.append(by_owner)
            self.owned += by_owner[rank]
        self.local = recipe.over([(piece.name, piece.tensor) for piece in self.owned])

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


@dataclass(frozen=True)
class StateHolder:
    """A tensor a rank's optimizer keeps state for: of parameter `name`, placed at `piece` in the parameter's whole
    tensor; `writes` whether this rank writes that state into a checkpoint."""

    name: str
    tensor: torch.Tensor
    piece: TensorPiece
    writes: bool


def state_holders(optimizer, model: nn.Module, piece_of, writes) -> list[StateHolder]:
    """Each tensor `optimizer` keeps state for on this rank: the parameters it steps, or under ZeRO-1 the slices
    this rank owns (each owner writes what it holds). `piece_of(name, tensor)` places a parameter in its whole
    tensor, `writes(name, tensor)` says whether this rank writes a parameter it holds."""
    if isinstance(optimizer, ShardedOptimizer):
        holders = []
        for owned in optimizer.owned:
            parent = piece_of(owned.name, owned.param)
            offset = (parent.offset[0] + owned.start, *parent.offset[1:])
            holders.append(
                StateHolder(owned.name, owned.tensor, TensorPiece(owned.tensor, offset, parent.global_shape), True)
            )
        return holders
    names = {param: name for name, param in model.named_parameters()}
    held = [param for group in optimizer.param_groups for param in group["params"]]
    return [StateHolder(names[p], p, piece_of(names[p], p), writes(names[p], p)) for p in held]


def stepped_names(optimizer, model: nn.Module) -> dict[torch.Tensor, str]:
    """The parameter name of every tensor `optimizer` steps: the model's parameters, and ZeRO-1's slices."""
    names: dict[torch.Tensor, str] = {param: name for name, param in model.named_parameters()}
    if isinstance(optimizer, ShardedOptimizer):
        names.update({owned.tensor: owned.name for owned in optimizer.owned})
    return names
