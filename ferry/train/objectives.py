"""What a training step optimises: the next-token loss here, DPO and GRPO in their own modules.

The trainer owns the step's frame (learning rate, timer, optimizer update, router biases,
data cursor, the metrics every step reports); an objective owns what happens between:
which batches it reads, the forwards and backwards, and the figures only it knows. Every
objective reports the MoE diagnostics through the same `StepStatistics`, so routing health
is watched through pre-training, SFT, DPO and RL alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ferry.model.head_loss import HeadTargets
from ferry.train.losses import compute_loss
from ferry.train.step_statistics import StepStatistics

if TYPE_CHECKING:
    from ferry.train.trainer import Trainer


@dataclass
class StepOutcome:
    """What the trainer needs back from an objective's step: whether the optimizer stepped, the gradient
    norm, and the tokens the step processed over all ranks (for throughput and MFU)."""

    stepped: bool
    grad_norm: float
    tokens: int


class Objective(Protocol):
    extra_statistics: int

    def prepare(self, trainer: Trainer) -> list[str]:
        """Once the weights are in place (fresh, initialised or resumed): notes for the console."""

    def step(self, trainer: Trainer, statistics: StepStatistics) -> StepOutcome:
        """Forward and backward over this rank's share of the step, then `trainer.apply_update`."""

    def figures(self, statistics: StepStatistics, outcome: StepOutcome) -> dict:
        """The step's objective-specific metrics, from the statistics summed over every rank."""

    def evaluation_due(self, step: int, last_step: int) -> bool: ...

    def evaluate(self, trainer: Trainer, progress) -> dict: ...

    def state(self) -> dict:
        """What a checkpoint must carry to continue the objective (besides weights, optimizer and cursor)."""

    def load_state(self, state: dict | None) -> None: ...


class LanguageModelObjective:
    """Next-token cross-entropy over the trained targets (every token, or an SFT loss mask's)."""

    extra_statistics = 0

    def __init__(self, trainer: Trainer):
        self.tokens_per_step = trainer.tokens_per_step
        self.trained_targets = 0

    def prepare(self, trainer: Trainer) -> list[str]:
        return []

    def step(self, trainer: Trainer, statistics: StepStatistics) -> StepOutcome:
        config = trainer.config
        timer = trainer.metrics.timer
        trainer.optimizer.zero_grad(set_to_none=True)
        autocast = trainer.autocast()
        micro_batch = config.train.micro_batch
        batches = trainer.loader.micro_batches(trainer.cursor, trainer.rank, trainer.world_size, micro_batch)
        for batch in batches.micro:
            share = batch.inputs_BS.shape[0] / config.train.global_batch
            trainer.resilience.phase("forward")
            with timer.region("forward"), autocast:
                batch = batch.to(trainer.device)
                documents_BS = trainer.documents(batch.inputs_BS)
                head = HeadTargets(batch.targets_BS, config.train.loss_chunk) if config.train.loss_chunk else None
                output = trainer.model(
                    batch.inputs_BS, document_ids_BS=documents_BS, padding_BS=batch.padding_BS, targets=head
                )
                parts = compute_loss(output, batch.targets_BS, config.model.moe, batches.trained_targets, share)
            trainer.resilience.phase("backward")
            with timer.region("backward"):
                trainer.scaler.scale_loss(parts.objective).backward()
            statistics.add(parts, output, share)
        self.trained_targets = batches.trained_targets
        grad_norm, stepped = trainer.apply_update(trainer.cursor.step + 1)
        return StepOutcome(stepped, grad_norm, self.tokens_per_step)

    def figures(self, statistics: StepStatistics, outcome: StepOutcome) -> dict:
        lm_sum, correct, _, _ = statistics.losses()
        trained = max(self.trained_targets, 1)
        return {
            "loss": lm_sum / trained,
            "lm_loss": lm_sum / trained,
            "token_accuracy": correct / trained,
            "trained_share": self.trained_targets / self.tokens_per_step,
        }

    def evaluation_due(self, step: int, last_step: int) -> bool:
        return False

    def evaluate(self, trainer: Trainer, progress) -> dict:
        return {}

    def state(self) -> dict:
        return {"kind": "lm"}

    def load_state(self, state: dict | None) -> None:
        return None


def build_loader(config):
    """The data loader the objective reads: windows of a token mix (lm) or whole records (dpo, grpo)."""
    from ferry.data import MixedLoader
    from ferry.data.records import RecordLoader

    objective = config.train.objective
    if objective == "lm":
        return MixedLoader(config.data, seed=config.run.seed, global_batch=config.train.global_batch)
    kind = "preferences" if objective == "dpo" else "prompts"
    return RecordLoader(config.data, seed=config.run.seed, global_batch=config.train.global_batch, kind=kind)


def build_objective(trainer: Trainer) -> Objective:
    objective = trainer.config.train.objective
    if objective == "dpo":
        from ferry.train.dpo import DPOObjective

        return DPOObjective(trainer)
    if objective == "grpo":
        from ferry.train.grpo import GRPOObjective

        return GRPOObjective(trainer)
    return LanguageModelObjective(trainer)
