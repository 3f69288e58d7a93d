"""The DPO objective: preference pairs scored by the policy against the cached scores of the reference.

A step takes `train.global_batch` pairs; each micro-batch runs its pairs' chosen and
rejected sequences (prompt + answer) in one forward, sums each answer's token log-probs,
and adds the pair losses divided by the global batch, so the gradient is the mean over the
step's pairs whatever the split over ranks and micro-batches. Held-out pairs (`eval.sources`
holding preference datasets) report the same rewards without gradients.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ferry.data.records import RecordDataset
from ferry.data.targets import completion_batch
from ferry.inference.evaluation import held_out_due
from ferry.metrics.progress import WorkProgress
from ferry.train.losses import router_losses, router_objective
from ferry.train.objective_config import DPOConfig
from ferry.train.objectives import StepOutcome
from ferry.train.preference_losses import dpo_losses, token_logprobs
from ferry.train.reference import (
    LogprobCache,
    build_reference_model,
    parent_checkpoint,
    reference_record,
)
from ferry.train.step_statistics import StepStatistics

if TYPE_CHECKING:
    from ferry.model import Transformer
    from ferry.train.trainer import Trainer

# extra statistics: loss, chosen and rejected rewards, pairs ranked right, chosen and rejected log-probs, and the
# tokens the step put through the model (prompts and answers)
_SUMS = 7


class DPOObjective:
    extra_statistics = _SUMS

    def __init__(self, trainer: Trainer):
        config = trainer.config
        self.config = config.dpo
        self.dataset: RecordDataset = trainer.loader.dataset
        self.held_out = [
            RecordDataset(source.path, f"eval.sources.{index} ({source.name})", "preferences")
            for index, source in enumerate(config.eval.sources)
        ]
        for dataset in [self.dataset, *self.held_out]:
            _check_fits(dataset, config.model.max_seq_len)
        self.pad_id = trainer.loader.tokenizer["eos_id"]
        self.pairs_per_step = config.train.global_batch
        self.eval_interval = config.eval.interval
        self.reference: dict[str, torch.Tensor] = {}
        self.reference_pointer: dict | None = None

    def prepare(self, trainer: Trainer) -> list[str]:
        """Load the reference log-probs of the training and held-out pairs, computing what is not cached."""
        parent = parent_checkpoint(trainer)
        self.reference_pointer = reference_record(parent)
        directory = Path(self.config.reference_cache or trainer.config.run.path / "reference-cache")
        model: Transformer | None = None
        notes = []
        for dataset in [self.dataset, *self.held_out]:
            cache = LogprobCache(directory, self._cache_inputs(trainer, dataset))
            logps = cache.load()
            usable = logps is not None and logps.shape == (len(dataset), 2)
            # every rank scores together (expert parallelism) if any lacks the entry (e.g. no shared disk)
            if trainer.largest_over_ranks([0.0 if usable else 1.0])[0] > 0:
                model = model or build_reference_model(trainer, parent)
                logps = self._score_all(trainer, model, dataset)
                if trainer.is_main:
                    cache.save(logps)
                notes.append(
                    f"reference log-probs of {dataset.label} computed from {parent.path}, cached in {cache.path}"
                )
            else:
                notes.append(f"reference log-probs of {dataset.label} reused from {cache.path}")
            self.reference[dataset.label] = logps
        del model
        return notes

    def step(self, trainer: Trainer, statistics: StepStatistics) -> StepOutcome:
        config = trainer.config
        trainer.optimizer.zero_grad(set_to_none=True)
        records = trainer.loader.step_records(trainer.cursor, trainer.rank, trainer.world_size)
        reference = self.reference[self.dataset.label]
        for start in range(0, len(records.indices), config.train.micro_batch):
            indices = records.indices[start : start + config.train.micro_batch]
            share = len(indices) / records.global_count
            trainer.resilience.phase("forward")
            with trainer.metrics.timer.region("forward"), trainer.autocast():
                scored = score_pairs(trainer.model, self.dataset, indices, self.pad_id, trainer.device)
                logps_2B, tokens_2B, output = scored
                losses_B, chosen_B, rejected_B = pair_losses(self.config, logps_2B, tokens_2B, reference[indices])
                aux_loss, z_loss = router_losses(output)
                objective = losses_B.sum() / records.global_count + share * router_objective(
                    config.model.moe, aux_loss, z_loss
                )
            trainer.resilience.phase("backward")
            with trainer.metrics.timer.region("backward"):
                trainer.scaler.scale_loss(objective).backward()
            statistics.add_router(aux_loss, z_loss, output, share)
            statistics.extra += _pair_sums(losses_B, chosen_B, rejected_B, logps_2B)
            statistics.extra[-1] += sum(self._sequence_tokens(index) for index in indices)
        grad_norm, stepped = trainer.apply_update(trainer.cursor.step + 1)
        return StepOutcome(stepped, grad_norm, tokens=0)

    def figures(self, statistics: StepStatistics, outcome: StepOutcome) -> dict:
        """The step's means over its pairs; the tokens the step scored (prompts and both answers, every rank)."""
        loss, chosen, rejected, right, logp_chosen, logp_rejected, tokens = statistics.extra.tolist()
        outcome.tokens = int(tokens)
        pairs = self.pairs_per_step
        return {
            "loss": loss / pairs,
            "rewards/chosen": chosen / pairs,
            "rewards/rejected": rejected / pairs,
            "rewards/margin": (chosen - rejected) / pairs,
            "rewards/accuracy": right / pairs,
            "logps/chosen": logp_chosen / pairs,
            "logps/rejected": logp_rejected / pairs,
        }

    def evaluation_due(self, step: int, last_step: int) -> bool:
        return held_out_due(bool(self.held_out), self.eval_interval, step, last_step)

    @torch.no_grad()
    def evaluate(self, trainer: Trainer, progress) -> dict:
        """Rewards on every held-out pair set: the same pairs every time, split over the ranks."""
        was_training = trainer.model.training
        trainer.model.eval()
        accuracy, margin = {}, {}
        try:
            for source, dataset in zip(trainer.config.eval.sources, self.held_out):
                sums = torch.zeros(_SUMS, dtype=torch.float64, device=trainer.device)
                for indices in _rank_batches(len(dataset), self.config.score_batch, trainer):
                    with trainer.autocast():
                        scored = score_pairs(trainer.model, dataset, indices, self.pad_id, trainer.device)
                        logps_2B, tokens_2B, _ = scored
                    reference = self.reference[dataset.label][indices]
                    losses_B, chosen_B, rejected_B = pair_losses(self.config, logps_2B, tokens_2B, reference)
                    if indices.size and indices[0] >= 0:
                        sums += _pair_sums(losses_B, chosen_B, rejected_B, logps_2B)
                    progress()
                trainer.plan.sum_over_ranks(sums)
                _, chosen, rejected, right, _, _, _ = sums.tolist()
                accuracy[source.name] = right / len(dataset)
                margin[source.name] = (chosen - rejected) / len(dataset)
        finally:
            trainer.model.train(was_training)
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
    def _score_all(self, trainer: Trainer, model: Transformer, dataset: RecordDataset) -> torch.Tensor:
        """`[records, 2]` summed log-probs of every pair's chosen and rejected answer under `model`."""
        logps_N2 = torch.zeros(len(dataset), 2, dtype=torch.float64, device=trainer.device)
        batches = list(_rank_batches(len(dataset), self.config.score_batch, trainer))
        say = print if trainer.is_main else None
        label = f"reference log-probs of {dataset.label}"
        with WorkProgress(label, len(batches), say=say, unit=f"batches of {self.config.score_batch} pairs") as work:
            for indices in batches:
                with trainer.autocast():
                    logps_2B, _, _ = score_pairs(model, dataset, indices, self.pad_id, trainer.device)
                if indices.size and indices[0] >= 0:
                    logps_N2[indices] = logps_2B.double().view(2, -1).T
                trainer.resilience.watchdog.touch()  # scoring a large set is progress, not a hang
                work.advance()
        return trainer.plan.sum_over_ranks(logps_N2).cpu()

    def _cache_inputs(self, trainer: Trainer, dataset: RecordDataset) -> dict:
        config = trainer.config
        return {
            "parent": self.reference_pointer["digest"],
            "data": [entry["sha256"] for entry in dataset.file_hashes()],
            "model": config.model.model_dump(mode="json"),
            "precision": trainer.precision.as_dict(),
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


def score_pairs(
    model: Transformer, dataset: RecordDataset, indices: np.ndarray, pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, object]:
    """Summed answer log-probs and answer lengths, chosen answers first then rejected (`[2B]`), and the
    forward's output (for the router statistics)."""
    rows = [int(index) if index >= 0 else 0 for index in indices]  # -1: a filler row that keeps ranks in step
    prompts = [dataset.field(row, "prompt") for row in rows] * 2
    answers = [dataset.field(row, "chosen") for row in rows] + [dataset.field(row, "rejected") for row in rows]
    batch = completion_batch(prompts, answers, pad_id).to(device)
    output = model(batch.inputs_BS, padding_BS=batch.padding_BS)
    targets_BS = batch.targets_BS
    logps_2B = token_logprobs(output.logits_BSV, targets_BS).sum(dim=1)
    tokens_2B = (targets_BS >= 0).sum(dim=1).to(logps_2B.dtype)
    return logps_2B, tokens_2B, output


def _pair_sums(losses_B, chosen_B, rejected_B, logps_2B) -> torch.Tensor:
    """The pairs' sums in the statistics' extra slots (the last one, tokens, is added by the caller)."""
    pairs = losses_B.shape[0]
    return torch.stack(
        [
            losses_B.detach().sum(),
            chosen_B.sum(),
            rejected_B.sum(),
            (chosen_B > rejected_B).sum().to(chosen_B.dtype),
            logps_2B[:pairs].detach().sum(),
            logps_2B[pairs:].detach().sum(),
            torch.zeros((), device=logps_2B.device),
        ]
    ).double()


def _rank_batches(count: int, micro_batch: int, trainer: Trainer):
    """Micro-batches of record indices for this rank: batch j goes to rank j mod world size; every rank runs
    the same number of forwards (the last ones filled with index -1 where it has nothing left)."""
    world, rank = trainer.world_size, trainer.rank
    batches = [np.arange(start, min(start + micro_batch, count)) for start in range(0, count, micro_batch)]
    rounds = -(-len(batches) // world)
    for round_index in range(rounds):
        position = round_index * world + rank
        yield batches[position] if position < len(batches) else np.full(1, -1)


def _check_fits(dataset: RecordDataset, max_seq_len: int) -> None:
    from ferry.config import UserError

    if dataset.longest > max_seq_len:
        raise UserError(
            f"{dataset.label}: its longest pair ({dataset.longest} tokens with the prompt) exceeds model.max_seq_len "
            f"({max_seq_len})"
        )
