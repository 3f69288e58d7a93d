"""The layout of a job: how many ranks, how they split the experts, the pipeline's stages and the data, computed
once from the config and the world size, and checked once, before any rank builds anything.

    world = pp x replicas        a pipeline's ranks hold one stage each (loop-style, `pipeline_split.py`)
    replicas = dp x ep           inside a stage (or the whole job without a pipeline): each expert on one of `ep`
                                 ranks, the dense weights on all of them
    replicas = data ranks x cp   runs of `cp` consecutive replicas split every sequence of the same rows
    world = nodes x ranks a node consecutive ranks share a node (torchrun's LOCAL_WORLD_SIZE, or simulated nodes on
                                 one host: `parallel.ranks_per_node`); a group of ranks crosses the slow network
                                 only when it spans nodes (`link_tier`)
    ep = rail x ranks a node     an EP group of whole nodes exchanged hierarchically (`ep_topology`): a rail takes
                                 the rank at one place of each node, a node's ranks forward inside it

Everything that asks how the job is laid out reads this record: the parallel plan that places the model
(`ferry.parallel.plan`), the memory model, the run's records and every checkpoint's manifest. A refusal names the
setting to change and the values that fit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Literal

from ferry.config import UserError
from ferry.model import ModelConfig
from ferry.parallel.config import ParallelConfig
from ferry.parallel.pipeline_split import StageSplit, split_stages
from ferry.parallel.strategies import PLACEMENTS


@dataclass(frozen=True)
class JobLayout:
    """The ranks of a job and what each set of them shares. `split` is the pipeline's stages (None: no pipeline);
    `distributed` whether the ranks are processes of a group (a single process is laid out as one rank)."""

    world_size: int
    distributed: bool
    mode: str
    ep: int
    pp: int
    pp_schedule: str
    split: StageSplit | None
    cp: int = 1
    ranks_per_node: int = 0  # 0: every rank on one node
    ep_topology: str = "flat"  # how the expert exchange crosses nodes, as chosen (`choose_ep_topology`)

    @property
    def node_size(self) -> int:
        """The ranks one node holds."""
        return self.ranks_per_node or self.world_size

    @property
    def nodes(self) -> int:
        return self.world_size // self.node_size

    def link_tier(self, group: str) -> Literal["intra_node", "inter_node"]:
        """Whether each group of that kind (`world`, `replicas`: a stage's ranks, `ep`, `dp`: the ranks holding the
        same experts, `pp`, `cp`) lies inside a node or spans nodes. Ranks are placed in order, so a group of `count`
        ranks `stride` apart stays inside a node when count x stride ranks fit in one and tile it."""
        count, stride = self._group_shape(group)
        extent = count * stride
        inside = extent <= self.node_size and self.node_size % extent == 0
        return "intra_node" if inside or count == 1 else "inter_node"

    def _group_shape(self, group: str) -> tuple[int, int]:
        ep_degree = self.ep_degree
        shapes = {
            "world": (self.world_size, 1),
            "replicas": (self.replicas, 1),
            "ep": (ep_degree, 1),
            "dp": (self.replicas // ep_degree, ep_degree),
            "pp": (self.pp, self.replicas),
            "cp": (self.cp, 1),
            "ep_rail": (ep_degree // self.node_size, self.node_size) if self.ep_topology == "hierarchical" else (1, 1),
            "ep_node": (self.node_size, 1) if self.ep_topology == "hierarchical" else (1, 1),
        }
        if group not in shapes:
            raise ValueError(f"no group {group!r} in a job's layout; it has {', '.join(shapes)}")
        return shapes[group]

    @property
    def replicas(self) -> int:
        """The ranks a step's rows are split over: every rank, or one stage's ranks under a pipeline."""
        return self.world_size // self.pp

    @property
    def data_ranks(self) -> int:
        """The ranks a step's rows are split over: the replicas, less the context-parallel ranks sharing rows."""
        return self.replicas // self.cp

    @property
    def ep_degree(self) -> int:
        """The ranks each MoE layer's experts are split over (1 under a placement that replicates them: FSDP)."""
        return self.ep if PLACEMENTS[self.mode].splits_experts else 1

    def record(self) -> dict:
        """What a checkpoint's manifest and run.json record of it."""
        record = {
            "world_size": self.world_size,
            "ep_degree": self.ep_degree,
            "mode": self.mode if self.distributed else "single",
        }
        if self.cp > 1:
            record["cp_degree"] = self.cp
        if self.nodes > 1:
            record["nodes"] = self.nodes
        if self.ep_topology != "flat":
            record["ep_topology"] = self.ep_topology
        if self.split is not None:
            record.update(pp_degree=self.pp, pp_schedule=self.pp_schedule, pp_stages=self.split.describe())
        return record


def lay_out_job(
    parallel: ParallelConfig,
    model: ModelConfig,
    world_size: int,
    distributed: bool | None = None,
    ranks_per_node: int | None = None,
) -> JobLayout:
    """The layout of `world_size` ranks, refused (a `UserError` naming the setting) where they cannot take it:
    a pipeline degree that does not divide them, stages that do not split the blocks, a tied head on another stage
    than its embedding, an expert-parallel degree that does not divide the ranks of a stage or the experts, experts
    split under the FSDP baseline, a context-parallel degree that does not divide the ranks of a stage, nodes that
    do not split them. The ranks a node holds: `ranks_per_node` (a planner's), else `parallel.ranks_per_node`
    (simulated nodes), else the launcher's (`launcher_node_size`)."""
    distributed = world_size > 1 if distributed is None else distributed
    split = None
    if parallel.pp > 1:
        if world_size % parallel.pp:
            divisors = [degree for degree in range(2, world_size + 1) if world_size % degree == 0]
            raise UserError(
                f"parallel.pp: {parallel.pp} does not divide the world size {world_size}; set parallel.pp to one of "
                f"{divisors or [1]}, or run {parallel.pp} x k ranks"
            )
        split = split_stages(parallel, model)
    node_size = _node_size(world_size, ranks_per_node or parallel.ranks_per_node or launcher_node_size(world_size))
    layout = JobLayout(
        world_size,
        distributed,
        parallel.mode,
        parallel.ep,
        parallel.pp,
        parallel.pp_schedule,
        split,
        parallel.cp,
        ranks_per_node=0 if node_size == world_size else node_size,
    )
    _check_experts(parallel, model, layout)
    _check_context(parallel, layout)
    topology, reason = choose_ep_topology(parallel, model, layout)
    if parallel.ep_topology == "hierarchical" and topology != "hierarchical":
        raise UserError(f"parallel.ep_topology: hierarchical needs {reason}; set parallel.ep_topology flat or auto")
    return replace(layout, ep_topology=topology)


def choose_ep_topology(parallel: ParallelConfig, model: ModelConfig, layout: JobLayout) -> tuple[str, str]:
    """The expert exchange's topology for this job and why: hierarchical where `parallel.ep_topology` allows it and
    the layout gives it nodes to cross (an EP group of more than one whole node, exchanged in one piece); flat
    otherwise. `auto` also wants a token routed to several experts: with one, each token crosses at most once
    anyway, and the second stage would only add its rows' weights and ids. The reason says what holds, or for flat
    what hierarchical needs and what is missing."""
    ep, node = layout.ep_degree, layout.node_size
    if parallel.ep_topology == "flat":
        return "flat", "as configured"
    if ep <= node or ep % node:
        where = "inside one node" if ep <= node else f"over part of a node ({node} ranks a node)"
        return "flat", f"an EP group of more than one whole node (parallel.ep {ep} lies {where})"
    if parallel.ep_overlap != "none" or parallel.ep_dispatch != "permuted":
        shaped = f"ep_overlap {parallel.ep_overlap}, ep_dispatch {parallel.ep_dispatch} shape the flat exchange"
        return "flat", f"ep_overlap none and ep_dispatch permuted ({shaped})"
    if parallel.ep_topology == "auto" and model.moe.top_k == 1:
        return "flat", "a token routed to several experts (model.moe.top_k 1 sends each token at most once a node)"
    return "hierarchical", f"the EP group of {ep} ranks spans {ep // node} nodes of {node}"


def launcher_node_size(world_size: int) -> int:
    """The ranks a node holds as the launcher says (torchrun's `LOCAL_WORLD_SIZE` in a rank it started); outside a
    launcher, before any rank starts, the job is taken for one node (`ferry train --nproc N` runs on this host)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(local) if local and "WORLD_SIZE" in os.environ else world_size


def _node_size(world_size: int, node_size: int) -> int:
    if node_size > world_size or world_size % node_size:
        fitting = [size for size in range(1, world_size + 1) if world_size % size == 0]
        raise UserError(
            f"parallel.ranks_per_node: {node_size} does not split the world size {world_size} into whole nodes; set "
            f"one of {fitting}"
        )
    return node_size


def _check_context(parallel: ParallelConfig, layout: JobLayout) -> None:
    ranks = layout.replicas
    if ranks % parallel.cp:
        fitting = [cp for cp in range(1, ranks + 1) if ranks % cp == 0]
        where = f"the world size {ranks}" if layout.pp == 1 else f"the {ranks} ranks of each pipeline stage"
        raise UserError(
            f"parallel.cp: {parallel.cp} does not divide {where}; set parallel.cp to one of {fitting}, or run "
            f"{parallel.cp * layout.pp} x k ranks"
        )


def _check_experts(parallel: ParallelConfig, model: ModelConfig, layout: JobLayout) -> None:
    ranks = layout.replicas
    where = (
        f"the world size {ranks}"
        if layout.pp == 1
        else (f"the {ranks} ranks of each pipeline stage (world size / parallel.pp)")
    )
    num_experts = model.moe.num_experts
    if ranks % parallel.ep:
        fitting = [f"parallel.ep={ep}" for ep in range(1, ranks + 1) if ranks % ep == 0 and num_experts % ep == 0]
        choices = " or ".join([", ".join(fitting[:-1]), fitting[-1]] if len(fitting) > 1 else fitting)
        raise UserError(
            f"parallel.ep: {parallel.ep} does not divide {where}; set {choices} (the divisors of {ranks} that also "
            f"divide model.moe.num_experts, {num_experts})"
        )
    if num_experts % parallel.ep:
        raise UserError(f"parallel.ep: {parallel.ep} does not divide model.moe.num_experts ({num_experts})")
    if not PLACEMENTS[parallel.mode].splits_experts and parallel.ep != 1:
        raise UserError(
            f"parallel.ep: {parallel.mode.upper()} mode replicates experts; use parallel.ep=1 (got {parallel.ep})"
        )
