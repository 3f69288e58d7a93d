"""The next-token objective: pre-training, mid-training and SFT (whose loss mask leaves prompts out)."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from ferry.data import DataCursor, MixedLoader, document_ids
from ferry.model import MoEConfig
from ferry.model.config import MTPConfig
from ferry.model.head_loss import HeadTargets
from ferry.train.objectives.base import StepOutcome
from ferry.train.objectives.losses import compute_loss, mtp_figures, mtp_sums
from ferry.train.step_context import ForwardPass

if TYPE_CHECKING:
    from ferry.train.step_context import StepContext
    from ferry.train.step_statistics import StepStatistics


class LanguageModelObjective:
    """Next-token cross-entropy over the trained targets (every token, or an SFT loss mask's); with `model.mtp`,
    each multi-token-prediction module's too (`ferry/model/mtp.py`)."""

    def __init__(
        self,
        loader: MixedLoader,
        micro_batch: int,
        global_batch: int,
        loss_chunk: int,
        moe: MoEConfig,
        document_eos: int | None,
        tokens_per_step: int,
        mtp: MTPConfig = MTPConfig(),
    ):
        """`document_eos`: attention stays within documents ending with this token (None: plain causal);
        `loss_chunk`: the head and the loss computed together by chunks of that many tokens (0: logits first)."""
        self.loader = loader
        self.micro_batch = micro_batch
        self.global_batch = global_batch
        self.loss_chunk = loss_chunk
        self.moe = moe
        self.document_eos = document_eos
        self.tokens_per_step = tokens_per_step
        self.trained_targets = 0
        self.mtp = mtp
        self.statistics = mtp_sums(mtp.depth)

    def prepare(self, context: StepContext) -> list[str]:
        return []

    def step(self, context: StepContext, cursor: DataCursor, statistics: StepStatistics) -> StepOutcome:
        context.zero_grad()
        batches = self.loader.micro_batches(cursor, context.rank, context.world_size, self.micro_batch)
        passes = []
        for batch in batches.micro:
            share = batch.inputs_BS.shape[0] / self.global_batch
            batch = batch.to(context.device)
            head = self._head(batch.targets_BS)
            loss = partial(
                compute_loss,
                targets_BS=batch.targets_BS,
                moe=self.moe,
                trained_in_step=batches.trained_targets,
                share_of_step=share,
                mtp=self.mtp,
                own=statistics.own,
            )
            passes.append(
                ForwardPass(batch.inputs_BS, self._documents(batch.inputs_BS), batch.padding_BS, head, share, loss)
            )
        context.train_passes(passes, statistics)
        self.trained_targets = batches.trained_targets
        grad_norm, stepped = context.update(cursor.step + 1)
        return StepOutcome(stepped, grad_norm, self.tokens_per_step)

    def figures(self, statistics: StepStatistics, outcome: StepOutcome) -> dict:
        lm_sum, correct, _, _ = statistics.losses()
        trained = max(self.trained_targets, 1)
        return {
            "loss": lm_sum / trained,
            "lm_loss": lm_sum / trained,
            "token_accuracy": correct / trained,
            "trained_share": self.trained_targets / self.tokens_per_step,
            **mtp_figures(statistics.own.values(), self.mtp.depth),
        }

    def evaluation_due(self, step: int, last_step: int) -> bool:
        return False

    def evaluate(self, context: StepContext) -> dict:
        return {}

    def state(self) -> dict:
        return {"kind": "lm"}

    def load_state(self, state: dict | None) -> None:
        return None

    def _head(self, targets_BS) -> HeadTargets | None:
        """The targets the model computes its head's loss against, chunk by chunk (None: logits first). MTP modules
        compute theirs inside the forward, so with them the head does too: in one chunk when `loss_chunk` is 0."""
        if self.loss_chunk or self.mtp.depth:
            return HeadTargets(targets_BS, self.loss_chunk or targets_BS.numel())
        return None

    def _documents(self, inputs_BS):
        """Each position's document when `data.document_masking` is on (None: plain causal attention)."""
        if self.document_eos is None:
            return None
        return document_ids(inputs_BS, self.document_eos).to(inputs_BS.device)
