"""The objectives a run can train, one variant per kind, chosen by `train.objective`.

Each variant carries its settings (the `dpo` / `grpo` sections; the next-token objective has none of its own) and
answers every question the rest of the run would otherwise ask by branching on the objective's name: which loader
reads its data, which held-out sets it evaluates and under which names, the sequence length its FLOPs are counted
at, what one step takes, whether it draws its own training data, and how it is built. The config file keeps its
shape (`train.objective` with the `dpo` and `grpo` sections beside it), so configs and checkpoints written before
read the same; the union lives here, where the variant is picked once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

from ferry.config.refusals import Refusal
from ferry.data import MixedLoader
from ferry.data.records import RecordDataset, RecordLoader
from ferry.inference.config import EvalConfig
from ferry.train.objectives.base import Objective, RecordTraining
from ferry.train.objectives.config import DPOConfig, GRPOConfig
from ferry.train.objectives.dpo import DPOObjective
from ferry.train.objectives.grpo import GRPOObjective
from ferry.train.objectives.lm import LanguageModelObjective
from ferry.train.objectives.reference import ReferenceSource
from ferry.train.step_context import PassShape


class ObjectiveRun(Protocol):
    """What an objective's variant reads of a run config (`ferry.train.config.RunConfig`, which composes the
    objectives' settings and so is not imported here)."""

    run: Any
    model: Any
    data: Any
    train: Any
    eval: Any
    dpo: DPOConfig
    grpo: GRPOConfig
    init_from: str | None


@dataclass(frozen=True)
class ObjectiveInputs:
    """What an objective is built from besides its settings: the run's config (for the batch, the model's routing
    losses and length, the held-out sources), its loader, the way to its reference, and what identifies cached
    reference log-probs (model and precision settings)."""

    config: ObjectiveRun
    loader: MixedLoader | RecordLoader
    references: ReferenceSource
    cache_identity: dict


@dataclass(frozen=True)
class LanguageModelling:
    """Next-token loss: pre-training, mid-training, long-context and SFT (a loss mask leaves prompts out)."""

    kind: ClassVar[Literal["lm"]] = "lm"
    samples_its_data: ClassVar[bool] = False

    def loader(self, config: ObjectiveRun) -> MixedLoader:
        return MixedLoader(
            config.data, seed=config.run.seed, global_batch=config.train.global_batch, steps=config.train.steps
        )

    def token_evaluation(self, config: ObjectiveRun) -> EvalConfig:
        """Held-out token windows: the `eval` sources are token datasets."""
        return config.eval

    def held_out(self, config: ObjectiveRun) -> dict[str, RecordDataset]:
        return {}

    def sequence_length(self, config: ObjectiveRun, loader: MixedLoader) -> int:
        return config.data.seq_len

    def pass_shape(self, config: ObjectiveRun, loader: MixedLoader) -> PassShape:
        """Micro-batches of packed rows; the head's loss by chunks as `train.loss_chunk` says."""
        return PassShape(config.train.micro_batch, config.data.seq_len, config.train.loss_chunk)

    def step_unit(self, config: ObjectiveRun, tokens_per_step: int) -> str:
        return f"{tokens_per_step:,} tokens"

    def refusals(self, config: ObjectiveRun) -> list[Refusal]:
        return []

    def build(self, inputs: ObjectiveInputs) -> Objective:
        config = inputs.config
        train = config.train
        return LanguageModelObjective(
            inputs.loader,
            train.micro_batch,
            train.global_batch,
            train.loss_chunk,
            config.model.moe,
            inputs.loader.tokenizer["eos_id"] if config.data.document_masking else None,
            train.global_batch * config.data.seq_len,
            config.model.mtp,
        )


@dataclass(frozen=True)
class _RecordObjective:
    """What DPO and GRPO share: whole records, held-out record sets under their `eval` names."""

    record_kind: ClassVar[str]

    def loader(self, config: ObjectiveRun) -> RecordLoader:
        return RecordLoader(
            config.data, seed=config.run.seed, global_batch=config.train.global_batch, kind=self.record_kind
        )

    def refusals(self, config: ObjectiveRun) -> list[Refusal]:
        """What scores whole records cannot take of next-token training: its chunked head loss, the memory model's
        micro-batch and the MTP modules; and budgets of a token mix, which mean nothing to records read whole in the
        order of their steps (refused rather than ignored)."""
        kind, train = self.kind, config.train
        refused = []
        if train.loss_chunk:
            refused.append(
                Refusal(
                    "train.loss_chunk",
                    f"chunks the next-token loss (objective lm); {kind} scores its sequences' log-probs",
                )
            )
        if train.micro_batch == "auto":
            refused.append(
                Refusal(
                    "train.micro_batch",
                    f"auto is decided by the memory model of next-token training; objective {kind} needs a number",
                )
            )
        if config.model.mtp.depth:
            refused.append(
                Refusal(
                    "parallel",
                    f"model.mtp trains with the next-token objective (lm); {kind} scores sequences with the main head "
                    "alone: set model.mtp.depth=0 for this stage",
                )
            )
        for index, source in enumerate(config.data.sources):
            for budget in ("tokens", "epochs"):
                if getattr(source, budget) is not None:
                    refused.append(
                        Refusal(
                            "train",
                            f"objective {kind} reads whole records, not windows: data.sources.{index}.{budget} "
                            f"({source.name}) is a budget of a token mix; leave it out (train.steps sets how many "
                            "steps of records the run takes)",
                        )
                    )
        return refused

    def token_evaluation(self, config: ObjectiveRun) -> EvalConfig:
        """No token windows: the `eval` sources are record sets, which the objective evaluates itself."""
        return config.eval.model_copy(update={"sources": []})

    def held_out(self, config: ObjectiveRun) -> dict[str, RecordDataset]:
        return {
            source.name: RecordDataset(source.path, f"eval.sources.{index} ({source.name})", self.record_kind)
            for index, source in enumerate(config.eval.sources)
        }

    def record_training(self, inputs: ObjectiveInputs) -> RecordTraining:
        config = inputs.config
        return RecordTraining(
            inputs.loader,
            self.held_out(config),
            config.train.micro_batch,
            config.model.moe,
            config.model.max_seq_len,
            config.eval.interval,
            inputs.references,
        )


@dataclass(frozen=True)
class PreferenceOptimisation(_RecordObjective):
    """DPO against the parent's cached log-probs."""

    settings: DPOConfig
    kind: ClassVar[Literal["dpo"]] = "dpo"
    samples_its_data: ClassVar[bool] = False
    record_kind: ClassVar[str] = "preferences"

    def sequence_length(self, config: ObjectiveRun, loader: RecordLoader) -> int:
        """The longest pair: records are far shorter than `data.seq_len`."""
        return loader.dataset.longest

    def pass_shape(self, config: ObjectiveRun, loader: RecordLoader) -> PassShape:
        """Each pair twice (its prompt with the chosen, then with the rejected answer), scored from logits."""
        return PassShape(2 * config.train.micro_batch, self.sequence_length(config, loader), 0)

    def step_unit(self, config: ObjectiveRun, tokens_per_step: int) -> str:
        return f"{config.train.global_batch} preference pairs"

    def build(self, inputs: ObjectiveInputs) -> Objective:
        config = inputs.config
        cache_dir = Path(self.settings.reference_cache or config.run.path / "reference-cache")
        return DPOObjective(self.settings, self.record_training(inputs), cache_dir, inputs.cache_identity)


@dataclass(frozen=True)
class GroupRelativePolicyOptimisation(_RecordObjective):
    """GRPO: rollouts sampled from the policy, rewarded by a verifier."""

    settings: GRPOConfig
    kind: ClassVar[Literal["grpo"]] = "grpo"
    samples_its_data: ClassVar[bool] = True  # two runs part for good at the first token sampled otherwise
    record_kind: ClassVar[str] = "prompts"

    def sequence_length(self, config: ObjectiveRun, loader: RecordLoader) -> int:
        """The longest prompt with its completion."""
        return loader.dataset.longest + self.settings.max_new_tokens

    def pass_shape(self, config: ObjectiveRun, loader: RecordLoader) -> PassShape:
        """Each prompt's group of completions, scored from logits."""
        return PassShape(config.train.micro_batch * self.settings.group_size, self.sequence_length(config, loader), 0)

    def step_unit(self, config: ObjectiveRun, tokens_per_step: int) -> str:
        return f"{config.train.global_batch} prompts x {self.settings.group_size} sampled completions"

    def build(self, inputs: ObjectiveInputs) -> Objective:
        return GRPOObjective(self.settings, self.record_training(inputs), inputs.config.run.seed)


ObjectiveKind = LanguageModelling | PreferenceOptimisation | GroupRelativePolicyOptimisation


def objective_kind(config: ObjectiveRun) -> ObjectiveKind:
    """The variant `train.objective` names, with its settings."""
    return {
        "lm": lambda: LanguageModelling(),
        "dpo": lambda: PreferenceOptimisation(config.dpo),
        "grpo": lambda: GroupRelativePolicyOptimisation(config.grpo),
    }[config.train.objective]()


# Objectives that draw their own training data: two runs of one of them part for good at the first sampled token
# that falls on the other side of a probability boundary, so no per-step bound compares them.
SAMPLING_OBJECTIVES = frozenset(
    variant.kind
    for variant in (LanguageModelling, PreferenceOptimisation, GroupRelativePolicyOptimisation)
    if variant.samples_its_data
)
