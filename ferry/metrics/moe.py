"""MoE load diagnostics: where tokens went, how uneven that is, and whether the aux score tells the truth.

The switch aux score E * sum_e f_e * p_e (f: share of assignments, p: mean routing
probability) is 1.0 whenever *either* factor is uniform. A router whose
probabilities are nearly flat but whose top-k choices, decided by small margins,
all land on a few experts therefore scores a perfect 1.0 while those experts do
all the work: "token gerrymandering". `balance_gap` measures exactly that excess,
per expert and per expert-parallel rank (the unit whose slowest member every
all-to-all waits for); docs/metrics.md derives it.
"""

from __future__ import annotations

import torch

from ferry.config import UserError


def router_entropy(probs_TE: torch.Tensor, weight_T: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over tokens (weighted by `weight_T`, 0 for padding, when given) of the entropy (nats) of
    each token's routing distribution.

    `probs_TE` must sum to one per token (softmax scores, or sigmoid scores divided
    by their sum). ln(E) means the router cannot tell experts apart; 0 means certainty.
    """
    entropy_T = -torch.special.xlogy(probs_TE, probs_TE).sum(dim=-1)
    if weight_T is None:
        return entropy_T.mean()
    return (entropy_T * weight_T).sum() / weight_T.sum().clamp(min=1.0)


def dropped_tokens(tokens_per_expert_E: torch.Tensor, capacity: int) -> torch.Tensor:
    """Assignments one dispatch drops when each expert takes at most `capacity` of them."""
    return (tokens_per_expert_E - capacity).clamp(min=0).sum()


def moe_diagnostics(
    counts_LE: torch.Tensor,
    mean_prob_LE: torch.Tensor,
    entropy_L: torch.Tensor,
    dropped_L: torch.Tensor | None = None,
    ep_degree: int = 1,
) -> dict:
    """The step's `moe.*` record keys from what each MoE layer reported, summed over the step.

    counts_LE: assignments per expert (over micro-batches, and all-reduced over
    data-parallel ranks so that every rank reports the global load); mean_prob_LE:
    mean routing probability per expert over the same tokens; entropy_L: mean
    `router_entropy` over them; dropped_L: `dropped_tokens` summed (None when
    dropless); ep_degree: experts are placed on EP ranks in contiguous blocks of
    E / ep_degree. Per-layer values are lists; aggregates are the mean over layers,
    except dropped tokens (sum) and balance_gap (max: one gerrymandered layer must
    not be averaged away). A model without MoE layers has no `moe.*` keys.
    """
    layers, num_experts = counts_LE.shape
    if ep_degree < 1 or num_experts % ep_degree:
        raise UserError(f"ep_degree {ep_degree} does not divide the {num_experts} experts into equal groups")
    if not layers:
        return {}
    counts_LE = counts_LE.detach().to("cpu", torch.float64)
    total_L = counts_LE.sum(dim=1)
    if not bool((total_L > 0).all()):
        raise ValueError("every MoE layer must have routed at least one token in the step")
    load_LE = counts_LE / total_L[:, None]
    prob_LE = mean_prob_LE.detach().to("cpu", torch.float64)
    prob_LE = prob_LE / prob_LE.sum(dim=1, keepdim=True)
    rank_load_LR = load_LE.view(layers, ep_degree, -1).sum(dim=2)
    rank_prob_LR = prob_LE.view(layers, ep_degree, -1).sum(dim=2)

    mean_count_L = counts_LE.mean(dim=1)
    imbalance_L = counts_LE.amax(dim=1) / mean_count_L
    cv_L = counts_LE.std(dim=1, correction=0) / mean_count_L
    ep_imbalance_L = ep_degree * rank_load_LR.amax(dim=1)
    aux_score_L = num_experts * (load_LE * prob_LE).sum(dim=1)
    balance_gap_L = _concentration_gap(load_LE, prob_LE)
    if ep_degree > 1:
        balance_gap_L = torch.maximum(balance_gap_L, _concentration_gap(rank_load_LR, rank_prob_LR))
    dropped_L = torch.zeros(layers, dtype=torch.long) if dropped_L is None else dropped_L.detach().to("cpu").long()
    entropy_L = entropy_L.detach().to("cpu", torch.float64)

    record = {
        "moe.tokens_per_expert": counts_LE.long().tolist(),
        "moe.dropped_tokens": int(dropped_L.sum()),
        "moe.dropped_tokens_per_layer": dropped_L.tolist(),
    }
    for name, values_L, aggregate in (
        ("imbalance", imbalance_L, torch.mean),
        ("cv", cv_L, torch.mean),
        ("ep_imbalance", ep_imbalance_L, torch.mean),
        ("router_entropy", entropy_L, torch.mean),
        ("aux_score", aux_score_L, torch.mean),
        ("balance_gap", balance_gap_L, torch.max),
    ):
        record[f"moe.{name}"] = aggregate(values_L).item()
        record[f"moe.{name}_per_layer"] = values_L.tolist()
    return record


def _concentration_gap(load_LG: torch.Tensor, prob_LG: torch.Tensor) -> torch.Tensor:
    """G * sum_g f_g (f_g - p_g) over G groups (experts or EP ranks).

    G * sum f^2 is the score the aux formula would give if the probabilities followed
    the load (1 + CV^2 of the load); G * sum f p is the score it gives. Their difference
    is 0 for an honest router, and grows with load that probabilities do not show.
    """
    groups = load_LG.shape[1]
    return groups * (load_LG * (load_LG - prob_LG)).sum(dim=1)
