"""The DPO objective: preference pairs scored by the policy against the cached scores of the reference.

A step takes `train.global_batch` pairs; each micro-batch runs its pairs' chosen and
rejected sequences (prompt + answer) in one forward, sums each answer's token log-probs,
and adds the pair losses divided by the global batch, so the gradient is the mean over the
step's pairs whatever the split over ranks and micro-batches. Held-out pairs (`eval.sources`
holding preference datasets) report the same rewards without gradients.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ferry.data import DataCursor
from ferry.data.records import RecordDataset
from ferry.data.targets import Batch, completion_batch
from ferry.inference.evaluation import held_out_due
from ferry.inference.scoring import Scorer, ScoringPass
from ferry.metrics.progress import WorkProgress
from ferry.train.objectives.base import RecordTraining, StepOutcome
from ferry.train.objectives.config import DPOConfig
from ferry.train.objectives.losses import router_losses, router_objective
from ferry.train.objectives.preference_losses import dpo_losses, token_logprobs
from ferry.train.objectives.reference import LogprobCache
from ferry.train.step_context import ForwardPass
from ferry.train.step_statistics import LossParts, NamedSums

if TYPE_CHECKING:
    from ferry.model import ModelOutput, Transformer
    from ferry.train.step_context import StepContext
    from ferry.train.step_statistics import StepStatistics

# the sums of a step: the pairs' loss, the chosen and rejected rewards, the pairs ranked right, the chosen and
# rejected log-probs, and the tokens the step put through the model (prompts and answers)
DPO_STATISTICS = ("loss", "chosen", "rejected", "right", "logp_chosen", "logp_rejected", "tokens")


class DPOObjective:
    statistics = DPO_STATISTICS

    def __init__(
        self,
        config: DPOConfig,
        records: RecordTraining,
        cache_dir: Path,
        cache_identity: dict,
    ):
        """`records`: the pairs, the held-out pair sets and the reference (the stage's parent and its frozen
        model); the reference log-probs are cached in `cache_dir` under a key of the parent's digest, the data and
        `cache_identity` (model and precision)."""
        self.config = config
        self.loader = records.loader
        self.dataset: RecordDataset = records.loader.dataset
        self.held_out = records.held_out
        for dataset in [self.dataset, *self.held_out.values()]:
            _check_fits(dataset, records.max_seq_len)
        self.micro_batch = records.micro_batch
        self.moe = records.moe
        self.pad_id = records.loader.tokenizer["eos_id"]
        self.pairs_per_step = records.loader.global_batch
        self.eval_interval = records.eval_interval
        self.references = records.references
        self.cache_dir = cache_dir
        self.cache_identity = cache_identity
        self.reference: dict[str, torch.Tensor] = {}
        self.reference_pointer: dict | None = None

    def prepare(self, context: StepContext) -> list[str]:
        """Load the reference log-probs of the training and held-out pairs, computing what is not cached."""
        parent = self.references.checkpoint()
        self.reference_pointer = self.references.pointer(parent)
        model: Transformer | None = None
        notes = []
        for dataset in [self.dataset, *self.held_out.values()]:
            cache = LogprobCache(self.cache_dir, self._cache_inputs(dataset))
            logps = cache.load()
            usable = logps is not None and logps.shape == (len(dataset), 2)
            # every rank scores together (expert parallelism) if any lacks the entry (e.g. no shared disk)
            if context.reductions.largest([0.0 if usable else 1.0])[0] > 0:
                model = model or self.references.model(parent)
                logps = self._score_all(context, model, dataset)
                if context.rank == 0:
                    cache.save(logps)
                notes.append(
                    f"reference log-probs of {dataset.label} computed from {parent.path}, cached in {cache.path}"
                )
            else:
                notes.append(f"reference log-probs of {dataset.label} reused from {cache.path}")
            self.reference[dataset.label] = logps
        del model
        return notes

    def step(self, context: StepContext, cursor: DataCursor, statistics: StepStatistics) -> StepOutcome:
        context.zero_grad()
        records = self.loader.step_records(cursor, context.rank, context.world_size)
        passes = []
        for start in range(0, len(records.indices), self.micro_batch):
            indices = records.indices[start : start + self.micro_batch]
            share = len(indices) / records.global_count
            batch = pair_batch(self.dataset, indices, self.pad_id, context.device)
            loss = partial(self._pairs_loss, batch, indices, records.global_count, share, statistics.own)
            passes.append(ForwardPass(batch.inputs_BS, None, batch.padding_BS, None, share, loss))
        context.train_passes(passes, statistics)
        grad_norm, stepped = context.update(cursor.step + 1)
        return StepOutcome(stepped, grad_norm, tokens=0)

    def _pairs_loss(
        self,
        batch: Batch,
        indices: np.ndarray,
        pairs: int,
        share: float,
        own: NamedSums,
        output: ModelOutput,
    ) -> LossParts:
        """A micro-batch's pair losses over the step's `pairs`, with its routers' share; its pairs' sums (and the
        tokens it put through the model) added to the step's `own`."""
        logps_2B = _answer_logps(batch.targets_BS, output)
        tokens_2B = answer_tokens(batch.targets_BS, logps_2B.dtype)
        reference = self.reference[self.dataset.label]
        losses_B, chosen_B, rejected_B = pair_losses(self.config, logps_2B, tokens_2B, reference[indices])
        aux_loss, z_loss = router_losses(output)
        objective = losses_B.sum() / pairs + share * router_objective(self.moe, aux_loss, z_loss)
        own.add(**_pair_sums(losses_B, chosen_B, rejected_B, logps_2B))
        own.add(tokens=sum(self._sequence_tokens(index) for index in indices))
        return LossParts.of_objective(objective, aux_loss, z_loss)

    def figures(self, statistics: StepStatistics, outcome: StepOutcome) -> dict:
        """The step's means over its pairs; the tokens the step scored (prompts and both answers, every rank)."""
        sums = statistics.own.values()
        outcome.tokens = int(sums["tokens"])
        pairs = self.pairs_per_step
        return {
            "loss": sums["loss"] / pairs,
            "rewards/chosen": sums["chosen"] / pairs,
            "rewards/rejected": sums["rejected"] / pairs,
            "rewards/margin": (sums["chosen"] - sums["rejected"]) / pairs,
            "rewards/accuracy": sums["right"] / pairs,
            "logps/chosen": sums["logp_chosen"] / pairs,
            "logps/rejected": sums["logp_rejected"] / pairs,
        }

    def evaluation_due(self, step: int, last_step: int) -> bool:
        return held_out_due(bool(self.held_out), self.eval_interval, step, last_step)

    @torch.no_grad()
    def evaluate(self, context: StepContext) -> dict:
        """Rewards on every held-out pair set: the same pairs every time, split over the ranks."""
        accuracy, margin = {}, {}
        for name, dataset in self.held_out.items():
            sums = NamedSums.zeros(DPO_STATISTICS, context.device)
            for indices in _rank_batches(len(dataset), self.config.score_batch, context.rank, context.world_size):
                logps_2B, tokens_2B = score_pairs(context.score, dataset, indices, self.pad_id, context.device)
                reference = self.reference[dataset.label][indices]
                losses_B, chosen_B, rejected_B = pair_losses(self.config, logps_2B, tokens_2B, reference)
                if indices.size and indices[0] >= 0:
                    sums.add(**_pair_sums(losses_B, chosen_B, rejected_B, logps_2B))
                context.progress()
            context.reductions.sum_tensor(sums.vector)
            figures = sums.values()
            accuracy[name] = figures["right"] / len(dataset)
            margin[name] = (figures["chosen"] - figures["rejected"]) / len(dataset)
        return {"eval/rewards/accuracy": accuracy, "eval/rewards/margin": margin}

    def state(self) -> dict:
        return {"kind": "dpo", "reference": self.reference_pointer}

    def load_state(self, state: dict | None) -> None:
        return None

    def _sequence_tokens(self, index: int) -> int:
        """Tokens a pair puts through the model: its prompt twice and both answers."""
        lengths = self.dataset.spans[index, :, 1] - self.dataset.spans[index, :, 0]
        return int(2 * lengths[0] + lengths[1] + lengths[2])

    @torch.no_grad()
    def _score_all(self, context: StepContext, model: Transformer, dataset: RecordDataset) -> torch.Tensor:
        """`[records, 2]` summed log-probs of every pair's chosen and rejected answer under `model`."""
        logps_N2 = torch.zeros(len(dataset), 2, dtype=torch.float64, device=context.device)
        batches = list(_rank_batches(len(dataset), self.config.score_batch, context.rank, context.world_size))
        say = print if context.rank == 0 else None
        label = f"reference log-probs of {dataset.label}"
        score = partial(context.score, model=model)
        with WorkProgress(label, len(batches), say=say, unit=f"batches of {self.config.score_batch} pairs") as work:
            for indices in batches:
                logps_2B, _ = score_pairs(score, dataset, indices, self.pad_id, context.device)
                if indices.size and indices[0] >= 0:
                    logps_N2[indices] = logps_2B.double().view(2, -1).T
                context.progress()  # scoring a large set is progress, not a hang
                work.advance()
        return context.reductions.sum_tensor(logps_N2).cpu()

    def _cache_inputs(self, dataset: RecordDataset) -> dict:
        return {
            "parent": self.reference_pointer["digest"],
            "data": [entry["sha256"] for entry in dataset.file_hashes()],
            **self.cache_identity,
        }


def pair_losses(
    config: DPOConfig, logps_2B: torch.Tensor, tokens_2B: torch.Tensor, reference_B2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair: the DPO loss (with the chosen answer's NLL term) and the implicit rewards of both answers,
    from the policy's summed log-probs (`score_pairs`) and the reference's (`[pairs, 2]`)."""
    pairs = logps_2B.shape[0] // 2
    reference_2B = reference_B2.to(logps_2B).T.reshape(-1)
    chosen_nll_B = -logps_2B[:pairs] / tokens_2B[:pairs]
    if config.loss == "length_normalized":
        logps_2B, reference_2B = logps_2B / tokens_2B, reference_2B / tokens_2B
    losses_B, chosen_B, rejected_B = dpo_losses(
        logps_2B[:pairs], logps_2B[pairs:], reference_2B[:pairs], reference_2B[pairs:], config.beta, config.loss
    )
    if config.nll_weight:
        losses_B = losses_B + config.nll_weight * chosen_nll_B
    return losses_B, chosen_B, rejected_B


def pair_batch(dataset: RecordDataset, indices: np.ndarray, pad_id: int, device: torch.device) -> Batch:
    """The pairs' prompts with their answers, chosen answers first then rejected (`[2B]` rows)."""
    rows = [int(index) if index >= 0 else 0 for index in indices]  # -1: a filler row that keeps ranks in step
    prompts = [dataset.field(row, "prompt") for row in rows] * 2
    answers = [dataset.field(row, "chosen") for row in rows] + [dataset.field(row, "rejected") for row in rows]
    return completion_batch(prompts, answers, pad_id).to(device)


def score_pairs(
    score: Scorer,
    dataset: RecordDataset,
    indices: np.ndarray,
    pad_id: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed answer log-probs and answer lengths, chosen answers first then rejected (`[2B]`), scored by
    `score` (a step context's, or `ferry.inference.scoring.score_with(model)` in one process)."""
    batch = pair_batch(dataset, indices, pad_id, device)
    targets_BS = batch.targets_BS
    logps_2B = score(ScoringPass(batch.inputs_BS, batch.padding_BS, partial(_answer_logps, targets_BS)))
    return logps_2B, answer_tokens(targets_BS, logps_2B.dtype)


def answer_tokens(targets_BS: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (targets_BS >= 0).sum(dim=1).to(dtype)


def _answer_logps(targets_BS: torch.Tensor, output: ModelOutput) -> torch.Tensor:
    return output.summed(token_logprobs(output.logits_BSV, output.own(targets_BS)).sum(dim=1))


def _pair_sums(losses_B, chosen_B, rejected_B, logps_2B) -> dict[str, torch.Tensor]:
    """The pairs' sums under their statistics' names (the tokens are counted by the caller)."""
    pairs = losses_B.shape[0]
    return {
        "loss": losses_B.detach().sum().double(),
        "chosen": chosen_B.sum().double(),
        "rejected": rejected_B.sum().double(),
        "right": (chosen_B > rejected_B).sum().to(chosen_B.dtype).double(),
        "logp_chosen": logps_2B[:pairs].detach().sum().double(),
        "logp_rejected": logps_2B[pairs:].detach().sum().double(),
    }


def _rank_batches(count: int, micro_batch: int, rank: int, world_size: int):
    """Micro-batches of record indices for this rank: batch j goes to rank j mod world size; every rank runs
    the same number of forwards (the last ones filled with index -1 where it has nothing left)."""
    batches = [np.arange(start, min(start + micro_batch, count)) for start in range(0, count, micro_batch)]
    rounds = -(-len(batches) // world_size)
    for round_index in range(rounds):
        position = round_index * world_size + rank
        yield batches[position] if position < len(batches) else np.full(1, -1)


def _check_fits(dataset: RecordDataset, max_seq_len: int) -> None:
    from ferry.config import UserError

    if dataset.longest > max_seq_len:
        raise UserError(
            f"{dataset.label}: its longest pair ({dataset.longest} tokens with the prompt) exceeds model.max_seq_len "
            f"({max_seq_len})"
        )
