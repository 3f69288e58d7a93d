"""The parallel plan: how one model is laid out over the job's ranks, built once from the job's layout.

The model is built identically on every rank; the plan gives the ranks their groups (`RankGroups`, from the
layout: a (dp, ep) mesh, or a (pp, dp, ep) one under a pipeline), then composes the two strategies of
`ferry.parallel.strategies` on them: which blocks a rank keeps (all, or its pipeline stages'), and where the
weights of those blocks live (experts resident on their EP rank with dense weights replicated, or the FSDP
baseline). What follows from the placement (gradient reduction, clipping, the optimizer, a frozen copy laid out
alike) is the placement's; which rank writes a checkpoint piece and which rows a rank reads follow from the groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ferry.checkpoint import TensorPiece
from ferry.comm import (
    Collectives,
    CommStats,
    DistContext,
    build_context_group,
    build_exchange_groups,
    build_mesh,
    build_pipeline_mesh,
)
from ferry.model import Transformer
from ferry.model.experts import Experts
from ferry.parallel.config import ParallelConfig
from ferry.parallel.context_parallel import sequence_split
from ferry.parallel.layout import JobLayout, lay_out_job
from ferry.parallel.optimizers import OptimizerRecipe
from ferry.parallel.pipeline_split import StageSplit
from ferry.parallel.strategies import (
    PLACEMENTS,
    PipelineStages,
    PlacedParams,
    Placement,
    RankGroups,
    Stages,
    WholeModel,
    exchange_chunks,
)
from ferry.parallel.zero import StateHolder, state_holders


@dataclass(frozen=True)
class ExpertSlice:
    """Which experts of the global [num_experts, ...] tensor this rank holds."""

    start: int
    stop: int
    num_experts: int


@dataclass(frozen=True)
class ParallelPlan:
    """The job's layout, this rank's groups and the strategies placing the model on them, and the parameters as
    placed: dense ones, and expert ones with the slice of the experts this rank holds."""

    layout: JobLayout
    context: DistContext
    stats: CommStats
    groups: RankGroups
    stages: Stages
    placement: Placement
    placed: PlacedParams
    expert_slices: dict[str, ExpertSlice]
    reduce_dtype: torch.dtype
    ep_overlap: dict  # how the MoE exchanges run as configured (`auto`'s trial records its choice with the run)
    logical_names: frozenset[str] = field(default_factory=frozenset)  # the whole model's state_dict names
    logical_params: frozenset[str] = field(default_factory=frozenset)  # and its parameters' (a stage holds part)

    @property
    def world(self) -> Collectives | None:
        return self.groups.world

    @property
    def replicas(self) -> Collectives | None:
        return self.groups.replicas

    @property
    def ep(self) -> Collectives | None:
        return self.groups.ep

    @property
    def dp(self) -> Collectives | None:
        return self.groups.dp

    @property
    def pp(self) -> Collectives | None:
        return self.groups.pp

    @property
    def split(self) -> StageSplit | None:
        return self.layout.split

    @property
    def cp(self) -> Collectives | None:
        return self.groups.cp

    @property
    def data_rank(self) -> int:
        """This rank's place among the ranks a step's rows are split over (a pipeline's ranks, and a context-parallel
        group's, read the same rows)."""
        return self.replicas.rank // self.layout.cp if self.replicas is not None else 0

    @property
    def data_world_size(self) -> int:
        return self.layout.data_ranks

    @property
    def cp_rank(self) -> int:
        return self.cp.rank if self.cp is not None else 0

    @property
    def ep_rank(self) -> int:
        return self.ep.rank if self.ep is not None else 0

    @property
    def collectives(self) -> list[Collectives]:
        return self.groups.distinct

    def attach_timer(self, timer) -> None:
        """Let every collective (and EP dispatch) report into the step timer's comm / ep_wait regions."""
        for collectives in self.collectives:
            collectives.timer = timer

    def piece(self, name: str, tensor: torch.Tensor) -> TensorPiece:
        """Where this rank's `tensor` (of parameter or buffer `name`) sits in the logical global tensor, whatever the
        layout: a shard the placement made (FSDP), an EP rank's experts, or all of it."""
        sharded = self.placement.shard_piece(tensor)
        if sharded is not None:
            return sharded
        expert_slice = self.expert_slices.get(name)
        if expert_slice is None:
            return TensorPiece.whole(tensor)
        offset = (expert_slice.start,) + (0,) * (tensor.ndim - 1)
        return TensorPiece(tensor, offset, (expert_slice.num_experts, *tensor.shape[1:]))

    def writes(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether this rank writes its piece of `name` into a checkpoint: a shard by the rank holding it, a slice
        or a replicated tensor by the first of the ranks holding it (`is_replica_writer`)."""
        return self.placement.shards(tensor) or self.is_replica_writer(name)

    def held_whole(self, tensor: torch.Tensor, piece: TensorPiece) -> bool:
        """Whether this rank holds `tensor`, at `piece` of its logical tensor, whole and as a plain tensor: a read
        may fill it in place."""
        return not self.placement.shards(tensor) and piece.global_shape == tuple(tensor.shape)

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of `tensor` (a parameter, its gradient or its optimizer state) as a plain tensor."""
        return self.placement.local(tensor)

    def state_holders(self, model: nn.Module, optimizer) -> list[StateHolder]:
        """Each tensor this rank's `optimizer` keeps state for, placed in its parameter's whole tensor."""
        return state_holders(optimizer, model, self.piece, self.writes)

    def is_replica_writer(self, name: str) -> bool:
        """Whether this rank writes parameter `name` (and its optimizer state) into a checkpoint: each logical
        tensor exactly once, an expert slice by the first of the ranks holding it, a dense tensor by the first of
        the ranks holding the dense weights (rank 0, or a stage's first rank)."""
        if name in self.expert_slices:
            return self.dp is None or self.dp.rank == 0
        return self.replicas is None or self.replicas.rank == 0

    def lay_out_frozen(self, model: Transformer) -> None:
        """Give a second model (a frozen reference, built like the trained one) this plan's stages and placement,
        so checkpoint pieces land in it as in the trained model and its forwards join the same all-to-alls (and
        pass between the same pipeline stages)."""
        self.stages.place(model, self.groups)
        self.placement.lay_out_frozen(model, self.groups)

    @property
    def dense_params(self) -> list[tuple[str, nn.Parameter]]:
        return self.placed.dense

    @property
    def expert_params(self) -> list[tuple[str, nn.Parameter]]:
        return self.placed.experts

    def sync_gradients(self) -> None:
        self.placement.sync_gradients(self.placed, self.groups, self.reduce_dtype)

    def clip_gradients(self, model: nn.Module, max_norm: float) -> float:
        """Clip to `max_norm` (0: measure only) by the norm of the whole, unsharded gradient."""
        return self.placement.clip_gradients(self.placed, self.groups, model, max_norm)

    def sum_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a statistic (e.g. expert loads) over the whole job."""
        if self.world is not None:
            self.world.all_reduce(tensor)
        return tensor

    def build_optimizer(self, recipe: OptimizerRecipe, zero: bool = False):
        """The recipe's optimizer over this rank's parameters (its state sharded over their replicas with `zero`)."""
        return self.placement.build_optimizer(self.placed, self.groups, recipe, zero)


def build_plan(
    config: ParallelConfig,
    context: DistContext,
    model: Transformer,
    device: torch.device,
    reduce_dtype: torch.dtype = torch.float32,
    layout: JobLayout | None = None,
) -> ParallelPlan:
    """Lay `model` (built identically on every rank) out over the job, in place; `layout` is the job's (laid out
    and checked once per run; when not given, here)."""
    if layout is None:
        layout = lay_out_job(config, model.config, context.world_size, context.is_distributed)
    stats = CommStats()
    groups = rank_groups(layout, context, device, stats)
    logical_names = frozenset(model.state_dict())
    logical_params = frozenset(name for name, _ in model.named_parameters())
    stages: Stages = PipelineStages(layout.split) if layout.split is not None else WholeModel()
    placement: Placement = PLACEMENTS[config.mode](config)
    stages.place(model, groups)
    placement.place(model, groups, device)
    if groups.cp is not None:
        model.split_sequences(sequence_split(groups.cp))
    expert_modules = {name for name, module in model.named_modules() if isinstance(module, Experts)}
    dense, experts, slices = [], [], {}
    ep_rank = groups.ep.rank if groups.ep is not None else 0
    num_experts = model.config.moe.num_experts
    for name, param in model.named_parameters():
        if placement.splits_experts and name.rsplit(".", 1)[0] in expert_modules:
            experts.append((name, param))
            local = param.shape[0]
            slices[name] = ExpertSlice(ep_rank * local, (ep_rank + 1) * local, num_experts)
        else:
            dense.append((name, param))
    overlap = {
        "mode": config.ep_overlap,
        "chunks": exchange_chunks(config),
        "dispatch": config.ep_dispatch,
        "topology": layout.ep_topology,
    }
    return ParallelPlan(
        layout,
        context,
        stats,
        groups,
        stages,
        placement,
        PlacedParams(dense, experts),
        slices,
        reduce_dtype,
        overlap,
        logical_names,
        logical_params,
    )


def rank_groups(layout: JobLayout, context: DistContext, device: torch.device, stats: CommStats) -> RankGroups:
    """This rank's groups on the layout's mesh: (pp, dp, ep) under a pipeline, (dp, ep) otherwise, none for one
    process; its context-parallel group beside them."""
    if not context.is_distributed:
        return RankGroups()

    def timed(group) -> Collectives:
        return Collectives(group, stats, device, layout.node_size)

    cp = timed(build_context_group(context, layout.cp)) if layout.cp > 1 else None
    rail = node = None
    if layout.ep_topology == "hierarchical":
        rail, node = (timed(group) for group in build_exchange_groups(context, layout.ep, layout.node_size))
    if layout.split is not None:
        groups = build_pipeline_mesh(context, layout.pp, layout.ep, device)
        return RankGroups(
            world=timed(None),
            replicas=timed(groups.replicas),
            ep=timed(groups.ep),
            dp=timed(groups.dp),
            pp=timed(groups.pp),
            cp=cp,
            ep_rail=rail,
            ep_node=node,
        )
    mesh = build_mesh(context, layout.ep, device)
    world = timed(None)
    return RankGroups(
        world=world,
        replicas=world,
        ep=timed(mesh["ep"].get_group()),
        dp=timed(mesh["dp"].get_group()),
        cp=cp,
        ep_rail=rail,
        ep_node=node,
    )
