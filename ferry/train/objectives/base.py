"""What every objective offers the trainer, and what it gets back from a step.

The trainer owns the step's frame (learning rate, timer, the statistics' reduction, router biases, data cursor,
the metrics every step reports); an objective owns its middle: which batches it reads, the forwards and
backwards, its updates, and the figures only it knows. It sees the run only through a `StepContext`. Every
objective reports the MoE diagnostics through the same `StepStatistics`, so routing health is watched through
pre-training, SFT, DPO and RL alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ferry.data import DataCursor
    from ferry.data.records import RecordDataset, RecordLoader
    from ferry.model import MoEConfig
    from ferry.train.objectives.reference import ReferenceSource
    from ferry.train.step_context import StepContext
    from ferry.train.step_statistics import StepStatistics


@dataclass
class StepOutcome:
    """What the trainer needs back from an objective's step: whether the optimizer stepped, the gradient
    norm, and the tokens the step processed over all ranks (for throughput and MFU)."""

    stepped: bool
    grad_norm: float
    tokens: int


@dataclass(frozen=True)
class RecordTraining:
    """What the objectives that train on whole records (DPO, GRPO) are built with besides their settings: the
    loader of their records, the held-out sets by their `eval.sources` names, the micro-batch (records a forward),
    the routers' settings, the model's length, the evaluation interval, and the stage's parent as the reference."""

    loader: RecordLoader
    held_out: dict[str, RecordDataset]
    micro_batch: int
    moe: MoEConfig
    max_seq_len: int
    eval_interval: int
    references: ReferenceSource


class Objective(Protocol):
    statistics: tuple[str, ...]  # the names of the objective's own sums in the step's statistics

    def prepare(self, context: StepContext) -> list[str]:
        """Once the weights are in place (fresh, initialised or resumed): notes for the console."""

    def step(self, context: StepContext, cursor: DataCursor, statistics: StepStatistics) -> StepOutcome:
        """Forward and backward over this rank's share of the step at `cursor`, then `context.update`."""

    def figures(self, statistics: StepStatistics, outcome: StepOutcome) -> dict:
        """The step's objective-specific metrics, from the statistics summed over every rank."""

    def evaluation_due(self, step: int, last_step: int) -> bool: ...

    def evaluate(self, context: StepContext) -> dict:
        """Held-out figures of the objective; `context.progress()` after each piece of work."""

    def state(self) -> dict:
        """What a checkpoint must carry to continue the objective (besides weights, optimizer and cursor)."""

    def load_state(self, state: dict | None) -> None: ...
