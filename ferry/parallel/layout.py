"""The layout of a job: how many ranks, how they split the experts, the pipeline's stages and the data, computed
once from the config and the world size, and checked once, before any rank builds anything.

    world = pp x replicas        a pipeline's ranks hold one stage each (loop-style, `pipeline_split.py`)
    replicas = dp x ep           inside a stage (or the whole job without a pipeline): each expert on one of `ep`
                                 ranks, the dense weights on all of them
    replicas = data ranks x cp   runs of `cp` consecutive replicas split every sequence of the same rows

Everything that asks how the job is laid out reads this record: the parallel plan that places the model
(`ferry.parallel.plan`), the memory model, the run's records and every checkpoint's manifest. A refusal names the
setting to change and the values that fit.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        if self.split is not None:
            record.update(pp_degree=self.pp, pp_schedule=self.pp_schedule, pp_stages=self.split.describe())
        return record


def lay_out_job(
    parallel: ParallelConfig, model: ModelConfig, world_size: int, distributed: bool | None = None
) -> JobLayout:
    """The layout of `world_size` ranks, refused (a `UserError` naming the setting) where they cannot take it:
    a pipeline degree that does not divide them, stages that do not split the blocks, a tied head on another stage
    than its embedding, an expert-parallel degree that does not divide the ranks of a stage or the experts, experts
    split under the FSDP baseline, a context-parallel degree that does not divide the ranks of a stage."""
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
    layout = JobLayout(
        world_size, distributed, parallel.mode, parallel.ep, parallel.pp, parallel.pp_schedule, split, parallel.cp
    )
    _check_experts(parallel, model, layout)
    _check_context(parallel, layout)
    return layout


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
