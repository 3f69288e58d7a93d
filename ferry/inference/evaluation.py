"""Held-out loss: the mean next-token cross-entropy of a model over fixed windows of prepared datasets
(over the trained tokens only, for conversations: the loss on assistant tokens).

The windows of a source are chosen once (evenly spread over the dataset) and are the
same at every evaluation and in every layout, so the curve over a run, and the
figure for a checkpoint, compare. Each evaluation batch is split over the ranks in
contiguous rows, every rank running the same number of forwards (expert
parallelism needs every rank in every all-to-all); the sums meet in one all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from ferry.config import UserError
from ferry.data import TokenDataset, document_ids
from ferry.data.targets import IGNORE_INDEX, split_windows
from ferry.data.tokenizer import encoding_digest, load_tokenizer
from ferry.inference.config import EvalConfig
from ferry.inference.scoring import Scorer, ScoringPass
from ferry.model import ModelOutput
from ferry.model.head_loss import HeadTargets


@dataclass(frozen=True)
class HeldOut:
    """One source's dataset and the windows evaluated, in order."""

    name: str
    dataset: TokenDataset
    windows: np.ndarray

    @classmethod
    def open(
        cls, name: str, path: str, label: str, seq_len: int, count: int, count_names: str, seq_len_name: str
    ) -> HeldOut:
        dataset = TokenDataset(path, label=label)
        dataset.check_seq_len(seq_len, seq_len_name)
        available = dataset.num_windows(seq_len)
        if available < count:
            raise UserError(
                f"{label}: {available} windows of {seq_len} tokens; the evaluation reads {count} "
                f"({count_names}): lower them or prepare more held-out text"
            )
        windows = (np.arange(count, dtype=np.int64) * available) // count
        if dataset.has_loss_mask and not any(dataset.window_mask(int(index), seq_len)[1:].any() for index in windows):
            raise UserError(f"{label}: the {count} windows evaluated hold no trained (assistant) token")
        return cls(name, dataset, windows)

    def inputs_and_targets(self, indices: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The windows' inputs and targets; with a loss mask (conversations) only trained targets count."""
        windows_BS1 = torch.from_numpy(np.stack([self.dataset.window(int(index), seq_len) for index in indices]))
        trained_BS1 = None
        if self.dataset.has_loss_mask:
            trained_BS1 = torch.from_numpy(np.stack([self.dataset.window_mask(int(i), seq_len) for i in indices]))
        return split_windows(windows_BS1, trained_BS1)


def check_dataset_tokenizer(dataset, digest: str | None, vocab_size: int, expected_from: str) -> None:
    """Refuse a prepared dataset (token or record) tokenized otherwise than the model's data, or with more
    tokens than the model has; `digest` is the model's tokenizer's `encoding_digest` (None: not known)."""
    tokenizer = dataset.tokenizer
    if digest is not None and encoding_digest(load_tokenizer(dataset.path / tokenizer["file"])) != digest:
        raise UserError(
            f"{dataset.label} was tokenized with another tokenizer than {expected_from}; "
            "prepare it with the same one (ferry data prepare --tokenizer PATH)"
        )
    if tokenizer["vocab_size"] > vocab_size:
        raise UserError(f"{dataset.label}: its tokenizer has {tokenizer['vocab_size']} tokens, the model {vocab_size}")


def held_out_due(has_sources: bool, interval: int, step: int, last_step: int) -> bool:
    """The schedule of every held-out evaluation (loss, DPO rewards, GRPO solve rates): every `eval.interval`
    steps and after the last one."""
    return has_sources and (step == last_step or (interval > 0 and step % interval == 0))


@dataclass(frozen=True)
class SourceLoss:
    loss: float
    tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))


class HeldOutEvaluation:
    """The evaluation a run config (or `ferry eval`) describes: sources, windows, batch split."""

    def __init__(
        self,
        config: EvalConfig,
        seq_len: int,
        batch_size: int,
        micro_batch: int,
        document_eos: int | None = None,
        labels: list[str] | None = None,
        count_names: str = "eval.batches x eval.batch_size",
        seq_len_name: str = "data.seq_len",
        loss_chunk: int = 0,
    ):
        """`document_eos`: mask attention within documents ending with this token, as training did.
        `labels` name each source in messages (default `eval.sources.<i> (<name>)`), `count_names` the
        settings that fix how many windows are read, `seq_len_name` the one that fixes their length.
        `loss_chunk`: the head and the loss by chunks of that many tokens, as `train.loss_chunk` trains,
        so that an evaluation never holds the full logits a training step does not hold."""
        self.config = config
        self.document_eos = document_eos
        self.loss_chunk = loss_chunk
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.micro_batch = micro_batch
        count = config.batches * batch_size
        labels = labels or [f"eval.sources.{index} ({source.name})" for index, source in enumerate(config.sources)]
        self.sources = [
            HeldOut.open(source.name, source.path, label, seq_len, count, count_names, seq_len_name)
            for source, label in zip(config.sources, labels)
        ]

    def check_tokenizer(self, digest: str, vocab_size: int, expected_from: str) -> None:
        """Refuse a source tokenized otherwise than the model's data (its loss would mean nothing);
        `digest` is the model's tokenizer's `encoding_digest`."""
        for source in self.sources:
            check_dataset_tokenizer(source.dataset, digest, vocab_size, expected_from)

    def due(self, step: int, last_step: int) -> bool:
        return held_out_due(bool(self.sources), self.config.interval, step, last_step)

    @torch.no_grad()
    def run(
        self,
        score: Scorer,
        device: torch.device,
        rank: int = 0,
        world_size: int = 1,
        sum_over_ranks: Callable[[torch.Tensor], None] | None = None,
        progress: Callable[[], None] | None = None,
    ) -> dict[str, SourceLoss]:
        """Every source's mean token loss over its windows (all ranks get the same figures), each micro-batch
        scored by `score` (a run's step context, or `score_with(model)`) among `world_size` ranks; `progress`
        is called after every forward (the hang watchdog's heartbeat)."""
        if self.batch_size % (self.micro_batch * world_size):
            raise ValueError(
                f"a batch of {self.batch_size} does not split into micro-batches of {self.micro_batch} "
                f"on {world_size} ranks"
            )
        sums_2N = torch.zeros(2 * len(self.sources), dtype=torch.float64, device=device)
        rows = self.batch_size // world_size
        for index, source in enumerate(self.sources):
            for batch_start in range(0, len(source.windows), self.batch_size):
                mine = source.windows[batch_start + rank * rows : batch_start + (rank + 1) * rows]
                for micro_start in range(0, rows, self.micro_batch):
                    inputs_BS, targets_BS = source.inputs_and_targets(
                        mine[micro_start : micro_start + self.micro_batch], self.seq_len
                    )
                    inputs_BS, targets_BS = inputs_BS.to(device), targets_BS.to(device)
                    sums_2N[2 * index] += score(self._scoring(inputs_BS, targets_BS)).double()
                    sums_2N[2 * index + 1] += (targets_BS != IGNORE_INDEX).sum().double()
                    if progress is not None:
                        progress()
        if sum_over_ranks is not None:
            sum_over_ranks(sums_2N)
        totals = sums_2N.tolist()
        return {
            source.name: SourceLoss(totals[2 * index] / max(totals[2 * index + 1], 1.0), int(totals[2 * index + 1]))
            for index, source in enumerate(self.sources)
        }

    def _scoring(self, inputs_BS: torch.Tensor, targets_BS: torch.Tensor) -> ScoringPass:
        """One micro-batch, reduced to its summed token loss."""
        head = HeadTargets(targets_BS, self.loss_chunk) if self.loss_chunk else None
        documents_BS = None if self.document_eos is None else document_ids(inputs_BS, self.document_eos)
        return ScoringPass(inputs_BS, None, partial(_loss_sum, targets_BS), documents_BS, head)


def _loss_sum(targets_BS: torch.Tensor, output: ModelOutput) -> torch.Tensor:
    """The summed token loss of the whole micro-batch (every rank's positions, under context parallelism)."""
    if output.head_loss is not None:
        return output.summed(output.head_loss.lm_loss_sum)
    logits_TV = output.logits_BSV.reshape(-1, output.logits_BSV.shape[-1]).float()
    targets_T = output.own(targets_BS).reshape(-1)
    return output.summed(F.cross_entropy(logits_TV, targets_T, ignore_index=IGNORE_INDEX, reduction="sum"))


def eval_record(losses: dict[str, SourceLoss]) -> dict:
    """The metrics record's keys for one evaluation."""
    return {
        "eval.loss": {name: result.loss for name, result in losses.items()},
        "eval.perplexity": {name: result.perplexity for name, result in losses.items()},
    }
