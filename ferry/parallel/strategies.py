"""The ways of placing a model over its ranks, each owning what follows from it: where the weights go, how their
gradients are reduced and clipped, which optimizer steps them, and which rank writes each checkpoint piece.

A run's plan composes two of them on the job's groups (`ferry.parallel.plan`):

    stages     WholeModel (every rank holds every block) | PipelineStages (each rank its stages' blocks)
    placement  ExpertResident (experts split over `ep`, dense weights replicated, DDP-style reduction, AdamW or
               ZeRO-1) | FullySharded (FSDP2 gathers every weight for each forward and backward: the baseline)

The groups (`RankGroups`) say which ranks share what, so a rule written once holds in every composition: dense
gradients are summed over the ranks holding the same dense weights (every rank, or one stage's ranks), expert
gradients over the ranks holding the same experts, the gradient norm over the pipeline, and a dense tensor is
written by the first of its replicas. Context parallelism (each rank a part of every sequence) places no weight:
its ranks are replicas like any other, so every rule above holds for it unchanged; it only gives the model its
sequence split (`ferry.parallel.context_parallel`) and the data its rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ferry.checkpoint import TensorPiece
from ferry.comm import Collectives
from ferry.model import Transformer
from ferry.parallel.config import ParallelConfig
from ferry.parallel.expert_parallel import AllToAllDispatcher, shard_experts
from ferry.parallel.fsdp import apply_fsdp
from ferry.parallel.gradients import clip_grad_norm, reduce_gradients
from ferry.parallel.hierarchical import HierarchicalDispatcher
from ferry.parallel.optimizers import OptimizerRecipe
from ferry.parallel.pipeline_split import StageSplit
from ferry.parallel.zero import ReplicaGroup, ShardedOptimizer

Params = list[tuple[str, nn.Parameter]]


@dataclass(frozen=True)
class RankGroups:
    """This rank's collectives: the whole job (`world`), the ranks holding its dense weights (`replicas`: every
    rank, or its stage's), the ranks its experts are split over (`ep`), the ranks holding the same experts (`dp`),
    its pipeline (`pp`: one rank of each stage), the ranks splitting its sequences (`cp`), and the two stages of a
    hierarchical expert exchange (`ep_rail`: the rank at its place on each node of its EP group; `ep_node`: its
    node's ranks). None where the job has no such group (one process; `pp` without a pipeline; `cp` without
    context parallelism; the exchange's stages with a flat one)."""

    world: Collectives | None = None
    replicas: Collectives | None = None
    ep: Collectives | None = None
    dp: Collectives | None = None
    pp: Collectives | None = None
    cp: Collectives | None = None
    ep_rail: Collectives | None = None
    ep_node: Collectives | None = None

    @property
    def distinct(self) -> list[Collectives]:
        unique: list[Collectives] = []
        for collectives in (self.world, self.ep, self.dp, self.replicas, self.pp, self.cp, self.ep_rail, self.ep_node):
            if collectives is not None and all(collectives is not seen for seen in unique):
                unique.append(collectives)
        return unique


@dataclass(frozen=True)
class PlacedParams:
    """A rank's parameters as placed: dense ones (replicated, or FSDP's shards) and the expert slices it holds."""

    dense: Params
    experts: Params


class Stages(Protocol):
    def place(self, model: Transformer, groups: RankGroups) -> None:
        """Keep this rank's blocks of `model` (drawn whole on every rank)."""


class WholeModel:
    """Every rank holds every block."""

    def place(self, model: Transformer, groups: RankGroups) -> None:
        return None


@dataclass(frozen=True)
class PipelineStages:
    """Each rank keeps its stages' consecutive blocks, the embedding with the first stage and the head with the
    last (`split`); the other blocks become parameterless stand-ins, so the names are the single process's."""

    split: StageSplit

    def place(self, model: Transformer, groups: RankGroups) -> None:
        stages = self.split.stages_of(groups.pp.rank)
        model.keep_only(
            self.split.blocks_of(groups.pp.rank), embedding=0 in stages, head=self.split.num_stages - 1 in stages
        )


class Placement(Protocol):
    """Where a model's weights live over the ranks that hold it, and what follows: reduction, clipping, the
    optimizer, a frozen copy laid out alike."""

    splits_experts: bool

    def place(self, model: Transformer, groups: RankGroups, device: torch.device) -> None: ...

    def sync_gradients(self, placed: PlacedParams, groups: RankGroups, reduce_dtype: torch.dtype) -> None: ...

    def clip_gradients(self, placed: PlacedParams, groups: RankGroups, model: nn.Module, max_norm: float) -> float: ...

    def build_optimizer(self, placed: PlacedParams, groups: RankGroups, recipe: OptimizerRecipe, zero: bool): ...

    def lay_out_frozen(self, model: Transformer, groups: RankGroups) -> None: ...

    def shards(self, tensor: torch.Tensor) -> bool:
        """Whether this placement shards `tensor` over the ranks (each of which then writes its own piece of a
        checkpoint), rather than holding it whole or replicated."""

    def shard_piece(self, tensor: torch.Tensor) -> TensorPiece | None:
        """Where this rank's shard of `tensor` sits in the whole; None for a tensor it does not shard."""

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of `tensor` as a plain tensor (the tensor itself where the placement holds it so)."""


@dataclass(frozen=True)
class ExpertResident:
    """The OLMo-core 3 design: each expert resident on one of `parallel.ep` ranks, tokens sent to it by
    all-to-all; dense weights replicated and their gradients summed DDP-style; AdamW, or ZeRO-1 with its state
    sharded over each parameter's replicas (`optim.zero`)."""

    config: ParallelConfig
    splits_experts = True

    def place(self, model: Transformer, groups: RankGroups, device: torch.device) -> None:
        self.lay_out_frozen(model, groups)

    def lay_out_frozen(self, model: Transformer, groups: RankGroups) -> None:
        """Experts sliced to this rank's and each MoE layer given its exchange (a frozen reference too, so its
        forwards join the same all-to-alls and checkpoint pieces land in it as in the trained model)."""
        if groups.ep is None or self.config.ep == 1:
            return
        num_experts = model.config.moe.num_experts
        for layer in model.moe_layers():
            shard_experts(layer.experts, groups.ep.rank, self.config.ep)
            layer.dispatcher = (
                HierarchicalDispatcher(groups.ep_rail, groups.ep_node, num_experts)
                if groups.ep_rail is not None
                else AllToAllDispatcher(
                    groups.ep, num_experts, exchange_chunks(self.config), self.config.ep_dispatch == "rowwise"
                )
            )

    def shards(self, tensor: torch.Tensor) -> bool:
        return False  # experts are split by the plan's slices, the rest replicated

    def shard_piece(self, tensor: torch.Tensor) -> TensorPiece | None:
        return None

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def sync_gradients(self, placed: PlacedParams, groups: RankGroups, reduce_dtype: torch.dtype) -> None:
        bucket = int(self.config.bucket_mib * 2**20)
        reduce_gradients([p for _, p in placed.dense], groups.replicas, reduce_dtype, bucket)
        reduce_gradients([p for _, p in placed.experts], groups.dp, reduce_dtype, bucket)

    def clip_gradients(self, placed: PlacedParams, groups: RankGroups, model: nn.Module, max_norm: float) -> float:
        """Clip to `max_norm` (0: measure only) by the norm of the whole gradient, every stage's and expert's."""
        return clip_grad_norm(
            [p for _, p in placed.dense], [p for _, p in placed.experts], groups.ep, max_norm, groups.pp
        )

    def build_optimizer(self, placed: PlacedParams, groups: RankGroups, recipe: OptimizerRecipe, zero: bool):
        """Every rank holds whole matrices (its experts whole, its stages' blocks whole), so Muon's iteration runs
        where the parameter lives; under ZeRO-1 on the rank that owns it, which then sends the update."""
        if zero and groups.world is not None:
            sharded = [ReplicaGroup(placed.dense, groups.replicas), ReplicaGroup(placed.experts, groups.dp)]
            return ShardedOptimizer(sharded, recipe)
        return recipe.over(placed.dense + placed.experts)


@dataclass(frozen=True)
class FullySharded:
    """The FSDP2 weight-gathering baseline the expert-resident design is measured against: every block sharded
    over all ranks, gathered for each forward and backward, gradients reduced inside the backward."""

    config: ParallelConfig
    splits_experts = False

    def place(self, model: Transformer, groups: RankGroups, device: torch.device) -> None:
        if groups.world is not None:
            apply_fsdp(model, device, groups.world)

    def shards(self, tensor: torch.Tensor) -> bool:
        """FSDP2's parameters (and their optimizer state) are DTensors sharded over the ranks."""
        return isinstance(tensor, DTensor)

    def shard_piece(self, tensor: torch.Tensor) -> TensorPiece | None:
        if not self.shards(tensor):
            return None
        _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return TensorPiece(tensor.to_local(), tuple(offset), tuple(tensor.shape))

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    def sync_gradients(self, placed: PlacedParams, groups: RankGroups, reduce_dtype: torch.dtype) -> None:
        return None  # FSDP reduced them inside the backward

    def clip_gradients(self, placed: PlacedParams, groups: RankGroups, model: nn.Module, max_norm: float) -> float:
        if groups.world is None:
            return clip_grad_norm([p for _, p in placed.dense], [], groups.ep, max_norm, groups.pp)
        limit = max_norm if max_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), limit)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def build_optimizer(self, placed: PlacedParams, groups: RankGroups, recipe: OptimizerRecipe, zero: bool):
        """FSDP shards the optimizer state with the weights (`optim.zero` is refused with it before any rank
        starts); Muon's whole-matrix work is shared among the ranks."""
        return recipe.over(placed.dense + placed.experts, groups.world)

    def lay_out_frozen(self, model: Transformer, groups: RankGroups) -> None:
        """A frozen reference sharded as the trained model is, so checkpoint pieces land in it alike and each of
        its forwards gathers its blocks as the trained model's do."""
        if groups.world is not None:
            apply_fsdp(model, next(model.parameters()).device, groups.world)


PLACEMENTS = {"ep": ExpertResident, "fsdp": FullySharded}


def exchange_chunks(config: ParallelConfig) -> int:
    """Parts of each MoE layer's exchange: one, or `ep_chunks` with `ep_overlap: chunked` (`auto` starts with
    one; its trial sets the fastest, `ferry/train/overlap_trial.py`)."""
    return config.ep_chunks if config.ep_overlap == "chunked" else 1
