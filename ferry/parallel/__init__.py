"""Parallelism: expert-resident EP with DDP-style dense reduction, ZeRO-1, and the FSDP baseline."""

from ferry.parallel.config import ParallelConfig
from ferry.parallel.plan import ExpertSlice, ParallelPlan, build_plan

__all__ = ["ParallelConfig", "ExpertSlice", "ParallelPlan", "build_plan"]
