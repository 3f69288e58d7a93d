"""Choosing the next token from logits: greedy, or temperature, top-k and top-p sampling.

Sampling runs on the CPU in float32 with a CPU generator, so a seed gives the same
tokens on every accelerator whenever the logits agree.
"""

from __future__ import annotations

import torch

from ferry.inference.config import GenerationConfig


def next_tokens(
    logits_BV: torch.Tensor, config: GenerationConfig, generator: torch.Generator | list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen token of every row and its log-probability under the model (temperature 1, unfiltered),
    which is what a policy-gradient update needs.

    With one generator per row, each row's draws depend on its own seed alone, not on which
    other rows share the batch (RL rollouts draw the same tokens whatever the world size).
    """
    logits_BV = logits_BV.float().cpu()
    logprobs_BV = torch.log_softmax(logits_BV, dim=-1)
    if config.temperature == 0.0:
        tokens_B = logits_BV.argmax(dim=-1)
    else:
        probs_BV = torch.softmax(filter_scores(logits_BV / config.temperature, config.top_k, config.top_p), dim=-1)
        if isinstance(generator, list):
            tokens_B = torch.cat([torch.multinomial(row_V, 1, generator=g) for row_V, g in zip(probs_BV, generator)])
        else:
            tokens_B = torch.multinomial(probs_BV, 1, generator=generator).squeeze(1)
    return tokens_B, logprobs_BV.gather(1, tokens_B[:, None]).squeeze(1)


def filter_scores(scores_BV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """-inf outside the top-k tokens and outside the smallest set whose probability reaches top_p.

    The most likely token always survives, so every row keeps something to sample.
    """
    if 0 < top_k < scores_BV.shape[-1]:
        kth_B1 = scores_BV.topk(top_k, dim=-1).values[:, -1:]
        scores_BV = scores_BV.masked_fill(scores_BV < kth_B1, float("-inf"))
    if top_p < 1.0:
        sorted_BV, order_BV = scores_BV.sort(dim=-1, descending=True)
        probs_BV = torch.softmax(sorted_BV, dim=-1)
        mass_before_BV = probs_BV.cumsum(dim=-1) - probs_BV
        drop_BV = mass_before_BV >= top_p
        drop_BV[:, 0] = False
        scores_BV = scores_BV.masked_fill(torch.zeros_like(drop_BV).scatter(1, order_BV, drop_BV), float("-inf"))
    return scores_BV
