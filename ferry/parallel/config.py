"""Parallel layout: expert parallelism (the default) or the FSDP weight-gathering baseline."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ferry.config.section import Section


class ParallelConfig(Section):
    """`ep` experts-resident mode shards experts over `ep` ranks and replicates dense weights;
    `fsdp` shards every weight (experts included) and gathers them each step."""

    mode: Literal["ep", "fsdp"] = "ep"
    ep: int = Field(1, ge=1, description="expert-parallel degree; divides the world size and num_experts")
    bucket_mib: float = Field(25.0, gt=0.0, description="gradient all-reduce bucket size")
    ep_overlap: Literal["none", "chunked", "auto"] = Field(
        "none",
        description="none: each MoE layer's dispatch, experts and combine in turn; chunked: each expert's rows split "
        "into ep_chunks parts, the dispatch of part k+1 and the combine of part k in flight while the experts "
        "compute part k (ferry/parallel/expert_parallel.py); the same numbers within float rounding. auto: trial "
        "steps of none and of 2 and 4 parts before the first step, the run restored after each, the fastest kept "
        "and every candidate's figures in run.json (ferry/train/overlap_trial.py; objective lm)",
    )
    ep_overlap_trial_steps: int = Field(3, ge=1, le=20, description="measured steps per candidate of auto")
    ep_dispatch: Literal["permuted", "rowwise"] = Field(
        "permuted",
        description="permuted: one exchange each way, the received rows copied into expert order and the outputs "
        "back; rowwise: one exchange per local expert, rows received straight into the experts' input and sent "
        "back from their output, no permutation copy (ferry/parallel/rowwise.py)",
    )

    @model_validator(mode="after")
    def _one_way_of_exchanging(self) -> ParallelConfig:
        if self.ep_dispatch == "rowwise" and self.ep_overlap != "none":
            raise ValueError(
                f"ep_dispatch rowwise exchanges per local expert, in one piece; ep_overlap {self.ep_overlap} splits "
                "the permuted exchange into parts: set one of them (ep_overlap auto measures rowwise among its "
                "candidates)"
            )
        return self
    ep_chunks: int = Field(2, ge=2, le=64, description="parts of a chunked exchange (ep_overlap: chunked)")
