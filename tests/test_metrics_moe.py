"""MoE load diagnostics: imbalance, CV, drops, entropy, the aux score, and the gap that catches gerrymandering."""

import math

import pytest
import torch

from ferry.config import UserError
from ferry.metrics import dropped_tokens, moe_diagnostics, router_entropy
from ferry.model import MoEConfig
from ferry.model.router import Router


def diagnose(counts, probs, ep_degree=1, entropy=None, dropped=None):
    counts_LE = torch.tensor([counts])
    probs_LE = torch.tensor([probs], dtype=torch.float64)
    entropy_L = torch.tensor([1.0 if entropy is None else entropy])
    return moe_diagnostics(counts_LE, probs_LE, entropy_L, dropped, ep_degree)


def test_load_statistics_of_a_known_distribution():
    record = diagnose([30, 10, 10, 30], [0.25] * 4)
    assert record["moe.tokens_per_expert"] == [[30, 10, 10, 30]]
    assert record["moe.imbalance"] == pytest.approx(30 / 20)
    assert record["moe.cv"] == pytest.approx(10 / 20)
    assert record["moe.dropped_tokens"] == 0
    assert record["moe.imbalance_per_layer"] == [pytest.approx(1.5)]


def test_aggregates_are_means_except_drops_sum_and_gap_takes_the_worst_layer():
    counts_LE = torch.tensor([[10, 10, 10, 10], [40, 0, 0, 0]])
    probs_LE = torch.full((2, 4), 0.25)
    record = moe_diagnostics(counts_LE, probs_LE, torch.tensor([1.0, 0.5]), torch.tensor([0, 7]))
    assert record["moe.imbalance_per_layer"] == pytest.approx([1.0, 4.0])
    assert record["moe.imbalance"] == pytest.approx(2.5)
    assert record["moe.router_entropy"] == pytest.approx(0.75)
    assert record["moe.dropped_tokens"] == 7 and record["moe.dropped_tokens_per_layer"] == [0, 7]
    assert record["moe.balance_gap_per_layer"] == pytest.approx([0.0, 3.0])
    assert record["moe.balance_gap"] == pytest.approx(3.0)


def test_an_honest_router_has_no_gap_however_imbalanced():
    record = diagnose([70, 10, 10, 10], [0.7, 0.1, 0.1, 0.1])
    assert record["moe.imbalance"] == pytest.approx(2.8)
    assert record["moe.aux_score"] == pytest.approx(1 + record["moe.cv"] ** 2)
    assert record["moe.balance_gap"] == pytest.approx(0.0, abs=1e-12)


def test_token_gerrymandering_by_a_real_router_is_caught():
    """Nearly flat probabilities, but the top-2 choice always lands on experts 0 and 1 by a hair."""
    torch.manual_seed(0)
    config = MoEConfig(num_experts=8, top_k=2)
    router = Router(16, config)
    with torch.no_grad():
        router.weight_ED.zero_()
        router.weight_ED[:2] = 1e-3
    x_TD = torch.rand(512, 16)
    routing = router(x_TD)
    probs_TE = torch.nn.functional.linear(x_TD, router.weight_ED).softmax(dim=-1)

    record = moe_diagnostics(
        routing.tokens_per_expert_E[None], probs_TE.mean(dim=0)[None], router_entropy(probs_TE)[None]
    )
    assert routing.aux_loss.item() == pytest.approx(1.0, abs=0.01)
    assert record["moe.aux_score"] == pytest.approx(routing.aux_loss.item(), rel=1e-6)
    assert record["moe.imbalance"] == pytest.approx(4.0)
    assert record["moe.router_entropy"] == pytest.approx(math.log(8), rel=1e-4)
    assert record["moe.balance_gap"] == pytest.approx(3.0, abs=0.01)


def test_load_concentrated_on_one_ep_rank_is_caught():
    """Experts 0-3 live on EP rank 0 and take every token while the probabilities stay flat."""
    record = diagnose([25, 25, 25, 25, 0, 0, 0, 0], [0.125] * 8, ep_degree=2)
    assert record["moe.aux_score"] == pytest.approx(1.0)
    assert record["moe.ep_imbalance"] == pytest.approx(2.0)
    assert record["moe.balance_gap"] == pytest.approx(1.0)


def test_the_rank_level_gap_counts_when_it_is_the_larger():
    counts, probs = [40, 20, 20, 20], [0.3, 0.0, 0.35, 0.35]
    per_expert = diagnose(counts, probs, ep_degree=1)["moe.balance_gap"]
    per_rank = diagnose(counts, probs, ep_degree=2)["moe.balance_gap"]
    assert per_expert == pytest.approx(4 * (0.4 * 0.1 + 0.2 * 0.2 - 2 * 0.2 * 0.15))
    assert per_rank == pytest.approx(2 * (0.6 * 0.3 - 0.4 * 0.3))
    assert per_rank > per_expert


def test_router_entropy_in_nats():
    uniform_TE = torch.full((3, 4), 0.25)
    certain_TE = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    assert router_entropy(uniform_TE).item() == pytest.approx(math.log(4))
    assert router_entropy(certain_TE).item() == 0.0


def test_dropped_tokens_over_capacity():
    assert dropped_tokens(torch.tensor([5, 2, 9, 0]), capacity=4).item() == 1 + 5


def test_ep_degree_must_divide_the_experts():
    with pytest.raises(UserError, match="ep_degree 3"):
        diagnose([1, 1, 1, 1], [0.25] * 4, ep_degree=3)


def test_a_dense_model_has_no_moe_keys():
    assert moe_diagnostics(torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0)) == {}
