"""The layout kinds a run composes, asked as one: its config turns some of them on, and every question is put to
each of those in one order (the pipeline's stages, then where the weights live, then the optimizer's sharding, then
the split sequences), so a kind's answer builds on the ones before it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ferry.train.layouts.base import LayoutKind, MemoryTerms, PlacedRun, RankShare, Traffic
from ferry.train.layouts.context import ContextParallel
from ferry.train.layouts.expert_resident import ExpertResident
from ferry.train.layouts.fully_sharded import FullySharded
from ferry.train.layouts.pipeline import PipelineParallel
from ferry.train.layouts.zero import ZeroOne
from ferry.train.step_context import TrainingContext

if TYPE_CHECKING:
    from ferry.parallel.layout import JobLayout
    from ferry.parallel.plan import ParallelPlan
    from ferry.train.step_context import ContextParts, PassShape

LAYOUT_KINDS: tuple[LayoutKind, ...] = (
    PipelineParallel(),
    ExpertResident(),
    FullySharded(),
    ZeroOne(),
    ContextParallel(),
)


@dataclass(frozen=True)
class RunLayout:
    """The kinds a run's config turns on, in the order they compose."""

    kinds: tuple[LayoutKind, ...]

    @classmethod
    def of(cls, config: Any) -> RunLayout:
        return cls(tuple(kind for kind in LAYOUT_KINDS if kind.active(config)))

    @property
    def names(self) -> list[str]:
        return [kind.name for kind in self.kinds]

    @property
    def keeps_part_of_model(self) -> bool:
        """A rank holds part of a model drawn whole (so it draws the whole at once, never later)."""
        return any(kind.keeps_part_of_model for kind in self.kinds)

    @property
    def casts_weights_itself(self) -> bool:
        """A kind gathers and casts the weights for each pass (the step's own casts would be redone by it)."""
        return any(kind.casts_weights_itself for kind in self.kinds)

    def job_refusals(self, config: Any, layout: JobLayout) -> list[str]:
        return [refusal for kind in self.kinds for refusal in kind.job_refusals(config, layout)]

    def shares(self, config: Any, layout: JobLayout, micro_batch: int, whole: RankShare) -> list[RankShare]:
        shares = [whole]
        for kind in self.kinds:
            shares = kind.shares(config, layout, micro_batch, shares)
        return shares

    def memory(self, config: Any, layout: JobLayout, terms: MemoryTerms) -> MemoryTerms:
        for kind in self.kinds:
            terms = kind.memory(config, layout, terms)
        return terms

    def traffic(self, config: Any, layout: JobLayout, micro_batch: int) -> list[Traffic]:
        """Every collective of a training step on one rank, kind by kind, each with the link tier its group
        crosses."""
        return [
            replace(traffic, tier=layout.link_tier(traffic.group))
            for kind in self.kinds
            for traffic in kind.traffic(config, layout, micro_batch)
        ]

    def step_context(self, run: PlacedRun, shape: PassShape, context: ContextParts) -> TrainingContext:
        """The first kind's that runs a step its own way (a pipeline's schedule, which splits sequences itself
        under context parallelism, comes before split sequences alone), else plain accumulation."""
        for kind in self.kinds:
            runs = kind.step_context(run, shape, context)
            if runs is not None:
                return runs
        return TrainingContext(context)

    def figures(self, plan: ParallelPlan, exchanged: dict) -> dict:
        figures: dict = {}
        for kind in self.kinds:
            figures.update(kind.figures(plan, exchanged))
        return figures

    def banner(self, layout: JobLayout) -> str:
        """The layout's part of the run's banner: `pp 2, ep 2, cp 2`."""
        return ", ".join(part for kind in self.kinds if (part := kind.banner(layout)))

    def announcements(self, config: Any, layout: JobLayout) -> list[str]:
        return [line for kind in self.kinds for line in kind.announcement(config, layout)]
