"""What each rank of a pipeline holds, for the memory model: its stages' parameters (the embedding on the first
stage, the head on the last) and how many micro-batches' activations it keeps at once, by the schedule."""

from __future__ import annotations

from dataclasses import dataclass

from ferry.parallel.layout import JobLayout
from ferry.parallel.pipeline_split import block_parameters, embedding_parameters
from ferry.train.config import RunConfig


@dataclass(frozen=True)
class RankShare:
    """One pipeline rank's part of the model and of a step's activations. `in_flight`: micro-batches whose
    activations the rank keeps at its peak; `head`: whether it computes the logits and the loss."""

    total_params: int
    expert_params: int
    layers: int
    head: bool
    in_flight: int


def pipeline_rank_shares(config: RunConfig, layout: JobLayout, micro_batch: int) -> list[RankShare]:
    """Every pipeline rank's share. Kept micro-batches follow the schedules' warm-up: GPipe and looped BFS run
    every forward of a stage before its backwards (all m), 1F1B's stage r runs pp - r forwards ahead, interleaved
    1F1B about pp per rank (an estimate: its warm-up depends on the rank and the virtual stages); zero bubble,
    whose weight halves wait for later slots, is counted at all m (an upper bound)."""
    parallel, model = config.parallel, config.model
    split = layout.split
    sizes = block_parameters(model)
    moe = model.moe
    expert_block = moe.num_experts * 3 * model.dim * moe.expert_ffn_dim
    embedding = embedding_parameters(model)
    micro_batches = max(config.train.global_batch // (micro_batch * layout.replicas), 1)
    shares = []
    for rank in range(parallel.pp):
        stages = split.stages_of(rank)
        blocks = sorted(split.blocks_of(rank))
        first, last = 0 in stages, split.num_stages - 1 in stages
        total = sum(sizes[block] for block in blocks) + embedding * (first + last) + (model.dim if last else 0)
        experts = expert_block * sum(1 for block in blocks if block >= model.dense_layers)
        if parallel.pp_schedule == "1f1b":
            in_flight = min(micro_batches, parallel.pp - rank)
        elif parallel.pp_schedule == "interleaved_1f1b":
            in_flight = min(micro_batches, parallel.pp)
        else:
            in_flight = micro_batches
        shares.append(RankShare(total, experts, len(blocks), last, in_flight))
    return shares
