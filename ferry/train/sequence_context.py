"""The step context of a context-parallel run (`parallel.cp`): the ranks of a group read the same rows, and the
model each of them holds computes its part of every sequence (`ferry.model.sequence_split`), so an objective's
passes, losses and scoring run unchanged.

What a group computes once, it must count once. A pass's token sums (the LM loss, correct predictions, the routers'
parts) are each rank's own positions and add up over the ranks as they are; what every rank of a group computes
whole (a scoring pass's reduction, which sums its positions over the group; an objective's own sums, made from
those) is counted by the group's first rank only. Generation decodes a token at a time from a cache, which a split
sequence has no part of: refused here, and before any rank starts (`RunConfig`).
"""

from __future__ import annotations

from ferry.config import UserError
from ferry.inference.generate import GenerationResult
from ferry.parallel.plan import ParallelPlan
from ferry.train.step_context import ContextParts, TrainingContext


class SequenceSplitContext(TrainingContext):
    """`TrainingContext` whose ranks split every sequence: `rank` and `world_size` are this rank's place among the
    ranks a step's rows are split over, `reductions` count each group once."""

    def __init__(self, parts: ContextParts, plan: ParallelPlan):
        super().__init__(parts)
        self._split_over(plan, plan.cp_rank == 0)

    def generate(self, *args, **kwargs) -> GenerationResult:
        raise UserError(
            "parallel.cp: generation decodes from a cache of whole sequences, which a context-parallel rank does not "
            "hold; set parallel.cp=1 for an objective that generates (grpo)"
        )
