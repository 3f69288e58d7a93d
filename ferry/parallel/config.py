"""Parallel layout: expert parallelism (the default) or the FSDP weight-gathering baseline, and pipeline stages."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from ferry.config.section import Section

PipelineScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zero_bubble"]
INTERLEAVED_SCHEDULES = ("interleaved_1f1b", "looped_bfs", "zero_bubble")
# torch's V-shaped schedules put the first and the last stage on one rank, a placement other than the loop the split
# follows (ferry/parallel/pipeline_split.py)
REFUSED_SCHEDULES = ("zbv", "dualpipev")


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

    ep_topology: Literal["flat", "hierarchical", "auto"] = Field(
        "auto",
        description="flat: every (token, expert) row straight to its expert's rank; hierarchical: when the EP group "
        "spans nodes, a token sent once to each node holding its experts and forwarded inside the node, its "
        "outputs summed there and sent back once (ferry/parallel/hierarchical.py; one piece each way, ep_overlap "
        "none, ep_dispatch permuted); auto: hierarchical where it applies (an EP group of whole nodes, more than "
        "one, exchanged in one piece), flat otherwise, the choice and its reason in the run's first lines",
    )
    cp: int = Field(
        1,
        ge=1,
        le=64,
        description="context-parallel degree: each of cp consecutive ranks computes 1/cp of every sequence (chunks i "
        "and 2cp-1-i of 2cp, for causal balance) and attention gathers the keys and values of the whole "
        "(ferry/parallel/context_parallel.py); they read the same rows, so the data is split over world / (pp x cp) "
        "ranks; experts may be split over them (ep)",
    )
    ranks_per_node: int | None = Field(
        None,
        ge=1,
        description="ranks a node holds, consecutive ranks sharing one: unset, the launcher's (torchrun's "
        "LOCAL_WORLD_SIZE; one node for --nproc on one host); set, the job's ranks grouped into nodes of this many "
        "(simulated nodes on one host, for tests and drills)",
    )
    pp: int = Field(
        1,
        ge=1,
        description="pipeline-parallel degree: stages of consecutive blocks, one per rank of a "
        "pipeline (ferry/parallel/pipeline_stage.py); divides the world size",
    )
    pp_schedule: PipelineScheduleName = Field(
        "1f1b",
        description="torch.distributed.pipelining's schedule: gpipe (all forwards, then all backwards), 1f1b (one "
        "forward, one backward), interleaved_1f1b, looped_bfs and zero_bubble (pp_virtual_stages >= 2 stages per "
        "rank, loop placement; looped_bfs runs each local stage's micro-batches breadth first; zero_bubble splits "
        "each backward into its input and weight halves, with kernels.policy portable and train.loss_chunk 0)",
    )
    pp_virtual_stages: int = Field(
        1, ge=1, le=16, description="stages per rank: 1 for gpipe and 1f1b, 2 or more for the interleaved schedules"
    )
    pp_split: Literal["even", "balanced"] | list[int] = Field(
        "even",
        description="blocks per stage: even (n_layers / stages each), balanced (consecutive blocks placed so that the "
        "largest stage's parameters, embedding and head included, are as few as possible), or a list of "
        "blocks per stage in order (recorded in run.json)",
    )

    @field_validator("pp_schedule", mode="before")
    @classmethod
    def _zero_bubble_is_refused_by_name(cls, schedule: object) -> object:
        if schedule in REFUSED_SCHEDULES:
            raise ValueError(
                f"{schedule}: torch's V-shaped schedules place the first and the last stage on one rank, not the loop "
                f"placement ferry splits stages into; choose one of {', '.join(PipelineScheduleName.__args__)}"
            )
        return schedule

    @model_validator(mode="after")
    def _pipeline_schedule_fits_its_stages(self) -> ParallelConfig:
        interleaved = self.pp_schedule in INTERLEAVED_SCHEDULES
        if self.pp > 1 and interleaved and self.pp_virtual_stages < 2:
            raise ValueError(
                f"pp_schedule {self.pp_schedule} interleaves several stages per rank: set pp_virtual_stages >= 2, or "
                "pp_schedule gpipe or 1f1b"
            )
        if not interleaved and self.pp_virtual_stages != 1:
            raise ValueError(
                f"pp_schedule {self.pp_schedule} runs one stage per rank (pp_virtual_stages {self.pp_virtual_stages}); "
                f"set pp_virtual_stages 1, or one of {', '.join(INTERLEAVED_SCHEDULES)}"
            )
        if isinstance(self.pp_split, list):
            stages = self.pp * self.pp_virtual_stages
            if len(self.pp_split) != stages or min(self.pp_split) < 1:
                raise ValueError(
                    f"pp_split {self.pp_split} must give each of the pp x pp_virtual_stages = {stages} stages at least "
                    "one block"
                )
        return self

    @model_validator(mode="after")
    def _one_way_of_exchanging(self) -> ParallelConfig:
        if self.ep_dispatch == "rowwise" and self.ep_overlap != "none":
            raise ValueError(
                f"ep_dispatch rowwise exchanges per local expert, in one piece; ep_overlap {self.ep_overlap} splits "
                "the permuted exchange into parts: set one of them (ep_overlap auto measures rowwise among its "
                "candidates)"
            )
        if self.ep_topology == "hierarchical" and (self.ep_overlap != "none" or self.ep_dispatch != "permuted"):
            raise ValueError(
                f"ep_topology hierarchical runs its two stages in one piece, permuted (ep_overlap {self.ep_overlap}, "
                f"ep_dispatch {self.ep_dispatch} are the flat exchange's): set ep_overlap none and ep_dispatch "
                "permuted, or ep_topology flat"
            )
        return self

    ep_chunks: int = Field(2, ge=2, le=64, description="parts of a chunked exchange (ep_overlap: chunked)")
