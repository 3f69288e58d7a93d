"""The losses of the preference and RL stages as plain tensor functions, checked against hand-computed values.

DPO (Rafailov et al. 2023) trains on the log-ratio of policy to reference for a chosen
and a rejected answer: `h = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r))`;
`sigmoid` minimises `-log sigmoid(beta h)`, `length_normalized` does the same with each
log-prob divided by its answer's tokens (the Tulu 3 variant, which stops the policy
preferring long answers), and IPO (Azar et al. 2023) regresses `h` to `1 / (2 beta)`
instead of pushing it without bound. The implicit reward of an answer is
`beta (log pi - log ref)`.

GRPO (Shao et al. 2024) scores each completion against the others sampled for the same
prompt: its advantage is the reward minus the group's mean (optionally divided by the
group's standard deviation), the policy ratio is clipped to `[1 - clip_low, 1 + clip_high]`
(DAPO's decoupled bounds), and the KL to the reference uses Schulman's k3 estimator
`exp(ref - logp) - (ref - logp) - 1`, unbiased, never negative and zero where the policies agree.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from ferry.data.targets import IGNORE_INDEX
from ferry.train.objectives.cross_entropy import cross_entropy

DPOLoss = Literal["sigmoid", "length_normalized", "ipo"]


def token_logprobs(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """log p(target) at every position, in float32; 0 where the target is IGNORE_INDEX."""
    logits_TV = logits_BSV.reshape(-1, logits_BSV.shape[-1]).float()
    losses_T = cross_entropy(logits_TV, targets_BS.reshape(-1), IGNORE_INDEX, "none")
    return -losses_T.view_as(targets_BS)


def dpo_losses(
    policy_chosen_B: torch.Tensor,
    policy_rejected_B: torch.Tensor,
    reference_chosen_B: torch.Tensor,
    reference_rejected_B: torch.Tensor,
    beta: float,
    kind: DPOLoss,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair: the loss, and the (detached) implicit rewards of the chosen and the rejected answer.

    The log-probs are sums over each answer's tokens (for `length_normalized`, the caller
    passes them divided by the answer's length).
    """
    chosen_ratio_B = policy_chosen_B - reference_chosen_B
    rejected_ratio_B = policy_rejected_B - reference_rejected_B
    margin_B = chosen_ratio_B - rejected_ratio_B
    if kind == "ipo":
        losses_B = (margin_B - 1.0 / (2.0 * beta)) ** 2
    else:
        losses_B = -F.logsigmoid(beta * margin_B)
    return losses_B, beta * chosen_ratio_B.detach(), beta * rejected_ratio_B.detach()


def group_advantages(rewards_PG: torch.Tensor, scale_by_std: bool, eps: float = 1e-4) -> torch.Tensor:
    """Each completion's reward minus its group's mean (one row per prompt, `G` completions each);
    divided by the group's (sample) standard deviation plus `eps` when `scale_by_std`."""
    centred_PG = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred_PG = centred_PG / (rewards_PG.std(dim=1, keepdim=True) + eps)
    return centred_PG


def clipped_policy_loss(
    logps_T: torch.Tensor, old_logps_T: torch.Tensor, advantages_T: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: the clipped surrogate loss `-min(r A, clip(r) A)` with `r = pi / pi_old`, and whether the
    clip decided it (the bound was the smaller term)."""
    ratio_T = torch.exp(logps_T - old_logps_T)
    unclipped_T = ratio_T * advantages_T
    clipped_T = torch.clamp(ratio_T, 1.0 - clip_low, 1.0 + clip_high) * advantages_T
    return -torch.minimum(unclipped_T, clipped_T), (clipped_T < unclipped_T).detach()


def k3_kl(logps_T: torch.Tensor, reference_logps_T: torch.Tensor) -> torch.Tensor:
    """Per token, Schulman's k3 estimate of KL(policy || reference) from the sampled token's log-probs."""
    log_ratio_T = reference_logps_T - logps_T
    return torch.exp(log_ratio_T) - log_ratio_T - 1.0
