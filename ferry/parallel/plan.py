"""The parallel plan: how one model is laid out over the job's ranks, built once from config.

`ep` mode (expert-resident, the default): the model is built identically on every
rank, then each MoE layer keeps only its EP rank's experts and gets an all-to-all
dispatcher; dense gradients are summed over all ranks, expert gradients over the
ranks holding the same experts. `fsdp` mode: every block is sharded with FSDP2 and
weights are gathered for each forward and backward (the baseline). With `pp` > 1 every rank draws the whole
model, then keeps only its pipeline stages' part (`ferry/parallel/pipeline_split.py`); the ranks of one stage form
its data-parallel replicas, inside which experts are split as above.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ferry.comm import Collectives, CommStats, DistContext, build_mesh, build_pipeline_mesh
from ferry.config import UserError
from ferry.model import Transformer
from ferry.model.experts import Experts
from ferry.parallel.adamw import fused_where_available
from ferry.parallel.config import ParallelConfig
from ferry.parallel.expert_parallel import AllToAllDispatcher, shard_experts
from ferry.parallel.fsdp import apply_fsdp
from ferry.parallel.gradients import clip_grad_norm, reduce_gradients
from ferry.parallel.pipeline_split import StageSplit, split_stages
from ferry.parallel.zero import ReplicaGroup, ShardedAdamW


@dataclass
class ExpertSlice:
    """Which experts of the global [num_experts, ...] tensor this rank holds."""

    start: int
    stop: int
    num_experts: int


@dataclass
class ParallelPlan:
    config: ParallelConfig
    context: DistContext
    stats: CommStats
    world: Collectives | None = None
    ep: Collectives | None = None
    dp: Collectives | None = None
    dense_params: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    expert_params: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    expert_slices: dict[str, ExpertSlice] = field(default_factory=dict)
    reduce_dtype: torch.dtype = torch.float32
    ep_overlap: dict = field(default_factory=dict)  # how the MoE exchanges run; `auto`'s trial adds its figures
    replicas: Collectives | None = None  # the ranks holding this rank's dense weights: all, or its stage's ranks
    pp: Collectives | None = None  # this rank's pipeline: one rank of each stage (pp > 1)
    split: StageSplit | None = None
    logical_names: set[str] = field(default_factory=set)  # the whole model's state_dict names, every stage's

    @property
    def pipelined(self) -> bool:
        return self.config.pp > 1

    @property
    def data_rank(self) -> int:
        """This rank's place among the ranks that share a step's rows (a pipeline's ranks read the same rows)."""
        return self.replicas.rank if self.pipelined else self.context.rank

    @property
    def data_world_size(self) -> int:
        return self.replicas.size if self.pipelined else self.context.world_size

    @property
    def ep_size(self) -> int:
        return self.config.ep

    @property
    def ep_rank(self) -> int:
        return self.ep.rank if self.ep is not None else 0

    @property
    def collectives(self) -> list[Collectives]:
        unique = []
        for collectives in (self.world, self.ep, self.dp, self.replicas, self.pp):
            if collectives is not None and all(collectives is not seen for seen in unique):
                unique.append(collectives)
        return unique

    def attach_timer(self, timer) -> None:
        """Let every collective (and EP dispatch) report into the step timer's comm / ep_wait regions."""
        for collectives in self.collectives:
            collectives.timer = timer

    def is_replica_writer(self, name: str) -> bool:
        """Whether this rank writes parameter `name` (and its optimizer state) into a checkpoint.

        Each logical tensor must be written exactly once: a dense tensor by rank 0, an
        expert slice by the first rank of the ranks holding that slice.
        """
        if name in self.expert_slices:
            return self.dp is None or self.dp.rank == 0
        if self.pipelined:
            return self.replicas.rank == 0  # each stage's tensors live on its ranks only
        return self.context.rank == 0

    def lay_out_frozen(self, model: Transformer) -> None:
        """Give a second model (a frozen reference, built like the trained one) this plan's expert layout,
        so checkpoint pieces land in it as in the trained model and its forwards join the same all-to-alls."""
        if self.config.mode == "fsdp" and self.context.is_distributed:
            raise UserError("a reference model needs parallel.mode: ep (FSDP mode is the weight-gathering baseline)")
        if self.ep is not None and self.config.mode == "ep" and self.config.ep > 1:
            num_experts = model.config.moe.num_experts
            for layer in model.moe_layers():
                shard_experts(layer.experts, self.ep.rank, self.config.ep)
                layer.dispatcher = AllToAllDispatcher(self.ep, num_experts, _chunks(self.config), _rowwise(self.config))

    def sync_gradients(self) -> None:
        """Reduce gradients across replicas (ep mode; FSDP reduces inside backward)."""
        if self.config.mode == "fsdp":
            return
        bucket = int(self.config.bucket_mib * 2**20)
        reduce_gradients([p for _, p in self.dense_params], self.replicas, self.reduce_dtype, bucket)
        reduce_gradients([p for _, p in self.expert_params], self.dp, self.reduce_dtype, bucket)

    def clip_gradients(self, model: nn.Module, max_norm: float) -> float:
        """Clip to `max_norm` (0: measure only) by the norm of the whole, unsharded gradient."""
        if self.config.mode == "fsdp" and self.context.is_distributed:
            limit = max_norm if max_norm > 0 else float("inf")
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), limit)
            return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        return clip_grad_norm(
            [p for _, p in self.dense_params], [p for _, p in self.expert_params], self.ep, max_norm, self.pp
        )

    def sum_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a statistic (e.g. expert loads) over the whole job."""
        if self.world is not None:
            self.world.all_reduce(tensor)
        return tensor

    def build_optimizer(self, decayed: set[str], weight_decay: float, zero: bool, **adamw_kwargs):
        """Plain AdamW, or ZeRO-1 (state sharded over each parameter's replica group)."""
        if zero and self.config.mode == "ep" and self.context.is_distributed:
            groups = [ReplicaGroup(self.dense_params, self.replicas), ReplicaGroup(self.expert_params, self.dp)]
            return ShardedAdamW(groups, decayed, weight_decay, **adamw_kwargs)
        if zero and self.config.mode == "fsdp":
            raise UserError("optim.zero: FSDP already shards optimizer state; set optim.zero=false with parallel.mode=fsdp")
        params = self.dense_params + self.expert_params
        return torch.optim.AdamW(
            [
                {"params": [p for n, p in params if n in decayed], "weight_decay": weight_decay},
                {"params": [p for n, p in params if n not in decayed], "weight_decay": 0.0},
            ],
            **adamw_kwargs,
            **fused_where_available([p for _, p in params]),
        )


def build_plan(
    config: ParallelConfig,
    context: DistContext,
    model: Transformer,
    device: torch.device,
    reduce_dtype: torch.dtype = torch.float32,
) -> ParallelPlan:
    """Lay `model` (built identically on every rank) out over the job, in place."""
    num_experts = model.config.moe.num_experts
    if context.world_size % config.ep:
        raise UserError(f"parallel.ep: {config.ep} does not divide the world size {context.world_size}")
    if num_experts % config.ep:
        raise UserError(f"parallel.ep: {config.ep} does not divide model.moe.num_experts ({num_experts})")
    if config.mode == "fsdp" and config.ep != 1:
        raise UserError(f"parallel.ep: FSDP mode replicates experts; use parallel.ep=1 (got {config.ep})")
    plan = ParallelPlan(config=config, context=context, stats=CommStats(), reduce_dtype=reduce_dtype)
    plan.ep_overlap = {"mode": config.ep_overlap, "chunks": _chunks(config), "dispatch": config.ep_dispatch}
    plan.logical_names = set(model.state_dict())
    if config.pp > 1:
        _keep_own_stages(plan, model, context, device)
    elif context.is_distributed:
        mesh = build_mesh(context, config.ep, device)
        plan.world = plan.replicas = Collectives(None, plan.stats, device)
        plan.ep = Collectives(mesh["ep"].get_group(), plan.stats, device)
        plan.dp = Collectives(mesh["dp"].get_group(), plan.stats, device)
    if context.is_distributed:
        if config.mode == "ep" and config.ep > 1:
            for layer in model.moe_layers():
                shard_experts(layer.experts, plan.ep.rank, config.ep)
                layer.dispatcher = AllToAllDispatcher(plan.ep, num_experts, _chunks(config), _rowwise(config))
        if config.mode == "fsdp":
            apply_fsdp(model, device, plan.world)
    expert_modules = {name for name, module in model.named_modules() if isinstance(module, Experts)}
    for name, param in model.named_parameters():
        owner = name.rsplit(".", 1)[0]
        if owner in expert_modules and config.mode == "ep":
            plan.expert_params.append((name, param))
            local = param.shape[0]
            plan.expert_slices[name] = ExpertSlice(plan.ep_rank * local, (plan.ep_rank + 1) * local, num_experts)
        else:
            plan.dense_params.append((name, param))
    return plan


def _keep_own_stages(plan: ParallelPlan, model: Transformer, context: DistContext, device: torch.device) -> None:
    """The pipeline's groups on a (pp, dp, ep) mesh, and the model cut down to this rank's stages."""
    config = plan.config
    if context.world_size % config.pp:
        raise UserError(f"parallel.pp: {config.pp} does not divide the world size {context.world_size}")
    if model.config.tie_embeddings:
        raise UserError("parallel.pp: model.tie_embeddings shares the first stage's embedding with the last stage's "
                        "head; set model.tie_embeddings=false or parallel.pp=1")
    groups = build_pipeline_mesh(context, config.pp, config.ep, device)
    plan.world = Collectives(None, plan.stats, device)
    plan.pp = Collectives(groups.pp, plan.stats, device)
    plan.replicas = Collectives(groups.replicas, plan.stats, device)
    plan.ep = Collectives(groups.ep, plan.stats, device)
    plan.dp = Collectives(groups.dp, plan.stats, device)
    plan.split = split_stages(config, model.config)
    pp_rank = plan.pp.rank
    stages = plan.split.stages_of(pp_rank)
    model.keep_only(plan.split.blocks_of(pp_rank), embedding=0 in stages, head=plan.split.num_stages - 1 in stages)


def _chunks(config: ParallelConfig) -> int:
    """Parts of each MoE layer's exchange: one, or `ep_chunks` with `ep_overlap: chunked` (`auto` starts with
    one; its trial sets the fastest, `ferry/train/overlap_trial.py`)."""
    return config.ep_chunks if config.ep_overlap == "chunked" else 1


def _rowwise(config: ParallelConfig) -> bool:
    return config.ep_dispatch == "rowwise"
