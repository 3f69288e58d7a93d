"""A checkpoint's figures on record datasets outside training (`ferry eval`): what a GRPO run reports on
held-out prompts (solve rates, sampled and greedy), and what a DPO run reports on held-out pairs
(implicit rewards against a reference), with the same code, seeds and settings as the run's own
evaluation, so that on the run's last checkpoint the figures are those its last record holds.

A preference set is also scored without a reference: how often the model itself gives the chosen answer
more probability than the rejected one, which any model (an SFT parent, an imported one) can be asked.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial

import numpy as np
import torch

from ferry.data.records import RecordDataset
from ferry.inference.generate import generate
from ferry.inference.scoring import score_with
from ferry.model import Transformer
from ferry.train.objectives.config import DPOConfig, GRPOConfig
from ferry.train.objectives.dpo import pair_losses, score_pairs
from ferry.train.objectives.grpo import EVAL_SAMPLES, solved_prompts
from ferry.train.objectives.verifiers import VERIFIERS


def prompt_figures(model: Transformer, dataset: RecordDataset, config: GRPOConfig, seed: int) -> dict:
    """Solve rates of `dataset`'s prompts: `EVAL_SAMPLES` completions a prompt drawn as the run's evaluation
    draws them (its temperature, seeds from `seed`), and one greedy completion."""
    max_new_tokens = config.eval_max_new_tokens or config.max_new_tokens
    longest_prompt = int((dataset.spans[:, 0, 1] - dataset.spans[:, 0, 0]).max())
    _check_fits(dataset, "prompt", longest_prompt, max_new_tokens, model)
    verify = VERIFIERS[config.verifier]
    generation = partial(generate, model)
    sampled = solved_prompts(
        generation, dataset, verify, max_new_tokens, temperature=config.temperature, samples=EVAL_SAMPLES, seed=seed
    )
    greedy = solved_prompts(generation, dataset, verify, max_new_tokens, temperature=0.0, samples=1, seed=seed)
    return {
        "kind": "prompts",
        "records": len(dataset),
        "solve_rate": sampled / len(dataset),
        "greedy_solve_rate": greedy / len(dataset),
        "verifier": config.verifier,
    }


@torch.no_grad()
def preference_figures(
    model: Transformer,
    dataset: RecordDataset,
    config: DPOConfig,
    reference: Transformer | None = None,
    autocast: AbstractContextManager | None = None,
    progress: Callable[[], None] = lambda: None,
) -> dict:
    """How `model` ranks each pair's answers by their summed log-probs; with a `reference`, DPO's implicit
    rewards (accuracy and margin, with the run's beta and loss) as its held-out evaluation reports them.
    `progress` is called after each batch of `config.score_batch` pairs."""
    _check_fits(dataset, "pair", dataset.longest, 0, model)
    device = next(model.parameters()).device
    pad_id = dataset.tokenizer["eos_id"]
    sums = torch.zeros(5, dtype=torch.float64)
    for start in range(0, len(dataset), config.score_batch):
        indices = np.arange(start, min(start + config.score_batch, len(dataset)))
        with autocast or nullcontext():
            logps_2B, tokens_2B = score_pairs(score_with(model), dataset, indices, pad_id, device)
            chosen_B, rejected_B = logps_2B.double().view(2, -1)
            pair = [(chosen_B > rejected_B).sum(), chosen_B.sum(), rejected_B.sum()]
            if reference is not None:
                reference_2B = score_pairs(score_with(reference), dataset, indices, pad_id, device)[0]
                _, chosen_reward_B, rejected_reward_B = pair_losses(
                    config, logps_2B, tokens_2B, reference_2B.double().view(2, -1).T
                )
                pair += [(chosen_reward_B > rejected_reward_B).sum(), (chosen_reward_B - rejected_reward_B).sum()]
        sums[: len(pair)] += torch.stack([value.double().cpu() for value in pair])
        progress()
    ranked, chosen, rejected, rewarded, margin = (value / len(dataset) for value in sums.tolist())
    figures = {
        "kind": "preferences",
        "records": len(dataset),
        "preference_accuracy": ranked,
        "logps/chosen": chosen,
        "logps/rejected": rejected,
    }
    if reference is not None:
        figures.update({"rewards/accuracy": rewarded, "rewards/margin": margin, "beta": config.beta})
    return figures


def _check_fits(dataset: RecordDataset, record: str, longest: int, new_tokens: int, model: Transformer) -> None:
    from ferry.config import UserError

    if longest + new_tokens > model.config.max_seq_len:
        generated = f" plus {new_tokens} generated" if new_tokens else ""
        raise UserError(
            f"{dataset.label}: its longest {record} ({longest} tokens{generated}) exceeds the model's max_seq_len "
            f"({model.config.max_seq_len})"
        )
