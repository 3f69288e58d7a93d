"""What a layout kind answers (`ferry/train/layouts/`), so that nothing else in `train/` branches on how a run is
placed over its ranks.

A layout kind is one way of placing a model (expert parallelism, FSDP, ZeRO-1 over the replicas, a pipeline of
stages, sequences split over a context-parallel group). A run composes the kinds its config turns on
(`RunLayout`), all on the one layout of its job (`ferry.parallel.layout.JobLayout`, computed once), and every
question below is asked of each active kind in turn:

    refusals        what the kind cannot do with the rest of the config (settings, model, objective, optimizer),
                    known as the config validates
    job_refusals    what it cannot do over a job of this size, known before any rank starts
    traffic         its collectives in a step: calls, bytes and the group they run in (what a planner asks)
    shares, memory  its terms of the memory model: the parts of the model the ranks hold, what a rank keeps
    step_context    how a step's micro-batches run under it (plain, pipelined, sequences split)
    figures         what the step record says of it
    announcement    the console line a run starts with

The kinds are stateless: each answer is a function of the config (and the job's layout) it is asked about. The
mechanisms themselves (where the weights go, how gradients are reduced, which rank writes which checkpoint piece)
are `ferry.parallel`'s; a kind only says what follows from them for the run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

from ferry.config.refusals import Refusal

if TYPE_CHECKING:
    from torch import nn

    from ferry.parallel.layout import JobLayout
    from ferry.parallel.plan import ParallelPlan
    from ferry.precision import PrecisionPolicy
    from ferry.train.step_context import ContextParts, PassShape, TrainingContext


@dataclass(frozen=True)
class RankShare:
    """One rank's part of the model and of a step's activations, for the memory model. `in_flight`: micro-batches
    whose activations the rank keeps at its peak; `head`: whether it computes the logits and the loss."""

    total_params: int
    expert_params: int
    layers: int
    head: bool
    in_flight: int


@dataclass(frozen=True)
class MemoryTerms:
    """What one rank holds, as the layout kinds shape it from the whole model on one process: its `share` of the model;
    its parameters (`local`) and the parameters it keeps optimizer state for (`moments`); the ranks its weights are
    sharded over (FSDP) and its experts split over (EP); the positions of a micro-batch it computes (`tokens`), each
    value `compute_bytes`; what a token keeps beyond a plain block's (`extra_kept_per_token_layer`, bytes: the
    exchanged rows a recompute reads, the keys and values gathered from other ranks)."""

    share: RankShare
    world_size: int
    local: float
    moments: float
    tokens: int
    compute_bytes: int
    weights_sharded_over: int = 1
    experts_split_over: int = 1
    extra_kept_per_token_layer: float = 0.0

    def with_(self, **changes: Any) -> MemoryTerms:
        return replace(self, **changes)


@dataclass(frozen=True)
class Traffic:
    """One collective of a step: `op` (the name the step record's comm stats use), how often it runs and its bytes
    per call and rank, the group it runs in (`group`: its name in the job's layout; `ranks`: its size), and the
    link tier it crosses (`tier`: inside a node, or between nodes when the group spans them; the run's composition
    fills it from the layout)."""

    op: str
    calls: int
    bytes_per_call: float
    group: str
    ranks: int
    tier: str = ""

    @property
    def bytes(self) -> float:
        return self.calls * self.bytes_per_call


@dataclass(frozen=True)
class PlacedRun:
    """What a kind builds a step context from: the run's config, its device, the model as the plan placed it, and the
    precision it computes in."""

    config: Any
    device: Any
    plan: ParallelPlan
    model: nn.Module
    precision: PrecisionPolicy


class LayoutKind(ABC):
    """One way of placing a model over ranks. Every question has a neutral answer here, so that a kind states only
    what it changes."""

    name: ClassVar[str]
    keeps_part_of_model: ClassVar[bool] = False  # a rank holds part of a model drawn whole (a pipeline's stages)
    casts_weights_itself: ClassVar[bool] = False  # it gathers and casts the weights for each pass (FSDP)

    @abstractmethod
    def active(self, config: Any) -> bool:
        """Whether `config` (`ferry.train.config.RunConfig`) turns this kind on."""

    def refusals(self, config: Any) -> list[Refusal]:
        """What this kind cannot do with the rest of `config` (checked whether or not it is active: a setting of
        its own on a run that does not use it is refused here too)."""
        return []

    def job_refusals(self, config: Any, layout: JobLayout) -> list[str]:
        """What it cannot do over the job `layout` describes (checked for active kinds only)."""
        return []

    def shares(self, config: Any, layout: JobLayout, micro_batch: int, shares: list[RankShare]) -> list[RankShare]:
        """The parts of the model the ranks hold (the memory model estimates the rank holding the most)."""
        return shares

    def memory(self, config: Any, layout: JobLayout, terms: MemoryTerms) -> MemoryTerms:
        """`terms` as this kind changes them."""
        return terms

    def traffic(self, config: Any, layout: JobLayout, micro_batch: int) -> list[Traffic]:
        """Its collectives in one training step of micro-batches of `micro_batch` sequences (fp32 on the wire
        unless the reduce dtype says otherwise), on one rank."""
        return []

    def step_context(self, run: PlacedRun, shape: PassShape, context: ContextParts) -> TrainingContext | None:
        """How a step's micro-batches run under it (the objective's largest micro-batch: `shape`); None leaves
        that to the other kinds (the plain loop)."""
        return None

    def figures(self, plan: ParallelPlan, exchanged: dict) -> dict:
        """What the step record says of it beyond every run's figures, from this rank's collectives of the step
        (`CommStats.take()`)."""
        return {}

    def announcement(self, config: Any, layout: JobLayout) -> list[str]:
        """The console lines a run starts with, about this kind."""
        return []

    def banner(self, layout: JobLayout) -> str:
        """Its part of the run's banner line (`pp 2`, `cp 2`); empty when it has none."""
        return ""
