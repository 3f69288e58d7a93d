"""Parallel layout: expert parallelism (the default) or the FSDP weight-gathering baseline."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ferry.config.section import Section


class ParallelConfig(Section):
    """`ep` experts-resident mode shards experts over `ep` ranks and replicates dense weights;
    `fsdp` shards every weight (experts included) and gathers them each step."""

    mode: Literal["ep", "fsdp"] = "ep"
    ep: int = Field(1, ge=1, description="expert-parallel degree; divides the world size and num_experts")
    bucket_mib: float = Field(25.0, gt=0.0, description="gradient all-reduce bucket size")
