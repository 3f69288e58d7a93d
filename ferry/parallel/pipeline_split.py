"""Where the pipeline's stage boundaries fall: how many consecutive blocks each stage holds, and which stages a
rank runs.

The embedding goes with the first stage and the final norm and head with the last, so a balanced split counts them
there: with a large vocabulary the first and last stages take fewer blocks. Stages are placed loop-style (rank r
runs stages r, r + pp, r + 2 pp, ...), the placement torch's interleaved schedules expect.
"""

from __future__ import annotations

from dataclasses import dataclass

from ferry.config import UserError
from ferry.model import ModelConfig
from ferry.parallel.config import ParallelConfig


@dataclass(frozen=True)
class StageSplit:
    """The blocks of every stage (`blocks[s]` the global indices of stage s) and the pipeline's degree."""

    blocks: tuple[tuple[int, ...], ...]
    pp: int

    @property
    def num_stages(self) -> int:
        return len(self.blocks)

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank `pp_rank` runs, in order."""
        return list(range(pp_rank, self.num_stages, self.pp))

    def blocks_of(self, pp_rank: int) -> set[int]:
        return {block for stage in self.stages_of(pp_rank) for block in self.blocks[stage]}

    def describe(self) -> dict:
        """What run.json records: blocks per stage and the stages of each pipeline rank."""
        return {
            "blocks_per_stage": [len(blocks) for blocks in self.blocks],
            "stages_of_rank": [self.stages_of(rank) for rank in range(self.pp)],
        }


def split_stages(parallel: ParallelConfig, model: ModelConfig) -> StageSplit:
    """The split `parallel.pp_split` asks for; one that leaves a stage without a block is refused, named."""
    stages = parallel.pp * parallel.pp_virtual_stages
    n_layers = model.n_layers
    if parallel.pp_split == "even":
        if n_layers % stages:
            fitting = [pp for pp in range(1, n_layers + 1) if n_layers % (pp * parallel.pp_virtual_stages) == 0]
            raise UserError(
                f"parallel.pp: {parallel.pp} x pp_virtual_stages {parallel.pp_virtual_stages} = {stages} stages do "
                f"not split model.n_layers ({n_layers}) evenly; set parallel.pp to one of {fitting}, or "
                "parallel.pp_split: balanced or a list of blocks per stage"
            )
        counts = [n_layers // stages] * stages
    elif parallel.pp_split == "balanced":
        if n_layers < stages:
            raise UserError(f"parallel.pp: {stages} stages need at least as many blocks; model.n_layers is {n_layers}")
        counts = balanced_counts(block_parameters(model), embedding_parameters(model), stages)
    else:
        counts = list(parallel.pp_split)
        if sum(counts) != n_layers:
            raise UserError(f"parallel.pp_split {counts} places {sum(counts)} blocks; model.n_layers is {n_layers}")
    starts = [sum(counts[:stage]) for stage in range(stages)]
    blocks = tuple(tuple(range(start, start + count)) for start, count in zip(starts, counts))
    return StageSplit(blocks, parallel.pp)


def block_parameters(model: ModelConfig) -> list[int]:
    """The parameters of each block (attention, norms, dense or MoE feed-forward)."""
    head_dim = model.head_dim
    attention = model.dim * head_dim * (model.n_heads * 2 + model.n_kv_heads * 2) + 2 * model.dim
    dense = 3 * model.dim * model.dense_ffn_dim
    moe = model.moe
    routed = moe.num_experts * 3 * model.dim * moe.expert_ffn_dim + moe.num_experts * model.dim
    shared = 3 * model.dim * moe.shared_expert_ffn_dim
    return [attention + (dense if index < model.dense_layers else routed + shared) for index in range(model.n_layers)]


def embedding_parameters(model: ModelConfig) -> int:
    """The parameters of the embedding (first stage), and of the head (last stage) unless it is tied."""
    return model.vocab_size * model.dim


def balanced_counts(blocks: list[int], embedding: int, stages: int) -> list[int]:
    """Blocks per stage, each at least one, minimising the largest stage's parameters (the embedding counted with
    the first stage, the head of the same size with the last): an exact search over the boundaries, cheap at any
    real number of blocks and stages."""
    n = len(blocks)
    prefix = [0]
    for size in blocks:
        prefix.append(prefix[-1] + size)

    def stage_size(stage: int, start: int, stop: int) -> int:
        extra = (embedding if stage == 0 else 0) + (embedding if stage == stages - 1 else 0)
        return prefix[stop] - prefix[start] + extra

    # best[s][i]: the smallest largest stage when stages 0..s-1 hold blocks 0..i-1, with where stage s-1 starts
    inf = float("inf")
    best = [[(inf, 0)] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0, 0)
    for stage in range(1, stages + 1):
        for stop in range(stage, n - (stages - stage) + 1):
            for start in range(stage - 1, stop):
                previous = best[stage - 1][start][0]
                largest = max(previous, stage_size(stage - 1, start, stop))
                if largest < best[stage][stop][0]:
                    best[stage][stop] = (largest, start)
    counts, stop = [], n
    for stage in range(stages, 0, -1):
        start = best[stage][stop][1]
        counts.append(stop - start)
        stop = start
    return counts[::-1]
