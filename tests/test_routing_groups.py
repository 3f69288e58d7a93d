"""DeepSeek-V3's routing in ferry's router: group-limited choice never leaves the token's best groups (a property
checked on many random routers against a per-token reference), the weights are the unbiased sigmoid scores
normalised and scaled, the same experts and weights as transformers' `DeepseekV3TopkRouter`, and the diagnostics
(load, mean probability, balancing loss) count what the experts actually receive."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as reference

from ferry.model.config import MoEConfig
from ferry.model.router import Router, count_assignments

SHAPES = [  # (num_experts, n_group, topk_group, top_k)
    (8, 4, 2, 2),
    (8, 4, 1, 2),
    (16, 4, 2, 6),
    (12, 3, 2, 5),
    (16, 8, 3, 4),
    (6, 2, 1, 3),
    (32, 8, 4, 8),
]


def sigmoid_router(num_experts: int, n_group: int, topk_group: int, top_k: int, seed: int, **extra) -> Router:
    config = MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        n_group=n_group,
        topk_group=topk_group,
        score_func="sigmoid",
        renormalize=True,
        bias_balancing={"enabled": True},
        expert_ffn_dim=8,
        **extra,
    )
    generator = torch.Generator().manual_seed(seed)
    router = Router(24, config)
    with torch.no_grad():
        router.weight_ED.copy_(torch.randn(num_experts, 24, generator=generator) * 0.5)
        router.expert_bias_E.copy_(torch.randn(num_experts, generator=generator) * 0.3)
    return router


def reference_choice(choice_E: list[float], n_group: int, topk_group: int, top_k: int) -> set[int]:
    """One token's experts, the plain way: rank groups by their two best scores, then experts within the best."""
    size = len(choice_E) // n_group
    groups = [sorted(choice_E[g * size : (g + 1) * size], reverse=True) for g in range(n_group)]
    best_groups = sorted(range(n_group), key=lambda g: sum(groups[g][:2]), reverse=True)[:topk_group]
    allowed = [e for e in range(len(choice_E)) if e // size in best_groups]
    return set(sorted(allowed, key=lambda e: choice_E[e], reverse=True)[:top_k])


@pytest.mark.parametrize("shape, seed", list(itertools.product(SHAPES, range(6))))
def test_group_limited_choice_never_leaves_the_best_groups(shape, seed):
    num_experts, n_group, topk_group, top_k = shape
    router = sigmoid_router(*shape, seed=seed)
    x_TD = torch.randn(40, 24, generator=torch.Generator().manual_seed(100 + seed))
    routing = router(x_TD)
    choice_TE = (router.weight_ED @ x_TD.T).T.sigmoid() + router.expert_bias_E
    size = num_experts // n_group
    for token, ids in enumerate(routing.expert_ids_TK.tolist()):
        assert len(set(ids)) == top_k
        assert len({expert // size for expert in ids}) <= topk_group
        assert set(ids) == reference_choice(choice_TE[token].tolist(), n_group, topk_group, top_k), token
    unlimited_TK = choice_TE.topk(top_k, dim=-1).indices
    limited = [set(ids) for ids in routing.expert_ids_TK.tolist()]
    assert limited != [set(ids) for ids in unlimited_TK.tolist()], "the limit must bind for some token"


def test_weights_are_the_unbiased_scores_normalised_then_scaled():
    router = sigmoid_router(16, 4, 2, 4, seed=1, routed_scaling_factor=2.5)
    x_TD = torch.randn(30, 24, generator=torch.Generator().manual_seed(2))
    routing = router(x_TD)
    scores_TE = (x_TD @ router.weight_ED.T).sigmoid()
    chosen_TK = scores_TE.gather(1, routing.expert_ids_TK)
    torch.testing.assert_close(routing.weights_TK, 2.5 * chosen_TK / chosen_TK.sum(-1, keepdim=True))
    torch.testing.assert_close(routing.weights_TK.sum(-1), torch.full((30,), 2.5))


@pytest.mark.parametrize("shape", SHAPES[:4])
def test_the_same_experts_and_weights_as_deepseek_v3s_router(shape):
    from transformers import DeepseekV3Config

    num_experts, n_group, topk_group, top_k = shape
    router = sigmoid_router(*shape, seed=3, routed_scaling_factor=1.8)
    hf = DeepseekV3Config(
        hidden_size=24,
        n_routed_experts=num_experts,
        num_experts_per_tok=top_k,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=1.8,
        norm_topk_prob=True,
    )
    theirs = reference.DeepseekV3TopkRouter(hf)
    with torch.no_grad():
        theirs.weight.copy_(router.weight_ED)
        theirs.e_score_correction_bias.copy_(router.expert_bias_E)
    x_TD = torch.randn(50, 24, generator=torch.Generator().manual_seed(4))
    ours = router(x_TD)
    _, their_weights_TK, their_ids_TK = theirs(x_TD)
    our_order_TK, their_order_TK = ours.expert_ids_TK.sort(-1), their_ids_TK.sort(-1)
    assert torch.equal(our_order_TK.values, their_order_TK.values)
    torch.testing.assert_close(
        ours.weights_TK.gather(1, our_order_TK.indices), their_weights_TK.gather(1, their_order_TK.indices)
    )


def test_diagnostics_count_what_the_experts_receive_whatever_the_scaling():
    plain = sigmoid_router(16, 4, 2, 4, seed=5)
    scaled = sigmoid_router(16, 4, 2, 4, seed=5, routed_scaling_factor=2.5)
    x_TD = torch.randn(64, 24, generator=torch.Generator().manual_seed(6))
    padding_T = torch.zeros(64, dtype=torch.bool)
    padding_T[-8:] = True
    first, second = plain(x_TD, padding_T), scaled(x_TD, padding_T)
    assert torch.equal(first.expert_ids_TK, second.expert_ids_TK)
    assert torch.equal(first.load_E, count_assignments(first.expert_ids_TK[:-8], 16))
    assert int(first.load_E.sum()) == 56 * 4 and int(first.tokens_per_expert_E.sum()) == 64 * 4
    assert torch.equal(first.aux_loss, second.aux_loss) and torch.equal(first.mean_prob_E, second.mean_prob_E)
    scores_TE = (x_TD[:-8] @ plain.weight_ED.T).sigmoid()
    torch.testing.assert_close(first.mean_prob_E, (scores_TE / scores_TE.sum(-1, keepdim=True)).mean(0))
