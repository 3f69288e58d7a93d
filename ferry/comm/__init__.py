"""Collectives: process groups and the device mesh from config, and one timed collectives interface."""

from ferry.comm.agreement import gather_objects, raise_on_every_rank
from ferry.comm.collectives import Collectives
from ferry.comm.config import CommConfig
from ferry.comm.process_group import (
    DistContext,
    PipelineGroups,
    build_context_group,
    build_exchange_groups,
    build_mesh,
    build_pipeline_mesh,
    init_distributed,
    launcher_ranks,
    resolve_backend,
    shutdown,
)
from ferry.comm.stats import LINK_TIERS, CommStats, OpStats, tier_figures

__all__ = [
    "Collectives",
    "CommConfig",
    "DistContext",
    "build_mesh",
    "build_context_group",
    "build_pipeline_mesh",
    "PipelineGroups",
    "gather_objects",
    "init_distributed",
    "launcher_ranks",
    "raise_on_every_rank",
    "resolve_backend",
    "shutdown",
    "CommStats",
    "OpStats",
    "LINK_TIERS",
    "tier_figures",
    "build_exchange_groups",
]
