"""Node-limited routing (`model.moe.max_nodes`, DeepSeek-V3's rule) on group-limited routing, the groups being the
nodes': a token's experts lie on at most max_nodes nodes, chosen as a brute-force reading of the rule chooses them
on random scores; a layout whose nodes do not hold whole groups is refused, and DeepSeek-V3's config expresses the
rule (n_group, topk_group) where the softmax-routed architectures refuse it by name."""

from __future__ import annotations

import itertools

import pytest
import torch

from ferry.config import UserError
from ferry.interop.architectures import hf_config, refusals
from ferry.model import ModelConfig
from ferry.model.config import MoEConfig
from ferry.model.router import Router


def _brute_force(scores_TE: torch.Tensor, nodes: int, max_nodes: int, top_k: int) -> list[set[int]]:
    """DeepSeek-V3's rule read literally, a token at a time: a node scores the sum of its top_k / max_nodes best
    experts; of every set of max_nodes nodes, the token takes the one whose node scores sum highest, then its top_k
    experts among those nodes' experts."""
    chosen = []
    per_node = scores_TE.shape[1] // nodes
    for scores in scores_TE.tolist():
        node_scores = [
            sum(sorted(scores[n * per_node : (n + 1) * per_node])[-(top_k // max_nodes) :]) for n in range(nodes)
        ]
        best = max(itertools.combinations(range(nodes), max_nodes), key=lambda kept: sum(node_scores[n] for n in kept))
        experts = [e for n in best for e in range(n * per_node, (n + 1) * per_node)]
        chosen.append(set(sorted(experts, key=lambda e: scores[e])[-top_k:]))
    return chosen


@pytest.mark.parametrize(("nodes", "max_nodes"), [(4, 2), (8, 4), (4, 1)])
def test_the_router_chooses_as_the_rule_reads_and_reaches_at_most_max_nodes(nodes, max_nodes):
    top_k = 2 * max_nodes  # a node ranked by its two best experts (top2_sum), as DeepSeek-V3's 8 of 4 nodes
    moe = MoEConfig(num_experts=4 * nodes, top_k=top_k, n_group=nodes, max_nodes=max_nodes, score_func="sigmoid")
    assert moe.topk_group == max_nodes
    torch.manual_seed(nodes + max_nodes)
    router = Router(16, moe)
    torch.nn.init.normal_(router.weight_ED)
    x_TD = torch.randn(300, 16)
    chosen = [set(row) for row in router(x_TD).expert_ids_TK.tolist()]
    scores_TE = torch.sigmoid(x_TD @ router.weight_ED.detach().T)
    assert chosen == _brute_force(scores_TE, nodes, max_nodes, top_k)
    assert max(len({expert // 4 for expert in experts}) for experts in chosen) <= max_nodes


def test_max_nodes_is_topk_group_and_needs_groups():
    with pytest.raises(ValueError, match="max_nodes 2 and topk_group 3: max_nodes is topk_group"):
        MoEConfig(num_experts=16, top_k=4, n_group=4, max_nodes=2, topk_group=3)
    with pytest.raises(ValueError, match="set n_group to the nodes the experts are spread over"):
        MoEConfig(num_experts=16, top_k=2, max_nodes=1)


def test_a_layout_whose_nodes_split_a_group_is_refused(make_config):
    routed = ("model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.n_group=2", "model.moe.max_nodes=1")
    batch = ("train.global_batch=8", "train.micro_batch=2")
    fits = make_config(*routed, *batch, "parallel.ep=4", "parallel.ranks_per_node=2")
    assert fits.check_world_size(4).nodes == 2  # a node holds 4 experts, a group 4
    split = make_config(
        *routed,
        *batch,
        "model.moe.n_group=4",
        "model.moe.top_k=2",
        "parallel.ep=4",
        "parallel.ranks_per_node=1",
        "model.moe.max_nodes=1",
    )
    split.check_world_size(4)  # 4 nodes of one rank: a node holds 2 experts, a group 2
    wide = make_config(*routed, *batch, "parallel.ep=4", "parallel.ranks_per_node=1")
    with pytest.raises(UserError, match=r"model.moe.max_nodes: a node holds 2 experts .* and a routing group 4"):
        wide.check_world_size(4)
    inside = make_config(*routed, *batch, "parallel.ep=2", "parallel.ranks_per_node=2")
    assert inside.check_world_size(4).link_tier("ep") == "intra_node"  # an exchange inside a node bounds nothing


def test_deepseek_v3_writes_the_rule_and_the_others_refuse_it():
    config = ModelConfig.model_validate(
        dict(
            dim=32,
            n_heads=4,
            n_layers=2,
            attention="mla",
            qk_norm=False,
            moe=dict(
                num_experts=16, top_k=4, n_group=4, max_nodes=2, score_func="sigmoid", bias_balancing={"enabled": True}
            ),
        )
    )
    assert refusals(config, "deepseek_v3") == []
    written = hf_config(config, "deepseek_v3", None, "float32")
    assert (written.n_group, written.topk_group) == (4, 2)
    gqa = ModelConfig.model_validate(
        dict(dim=32, n_heads=4, qk_norm=True, moe=dict(num_experts=8, n_group=2, max_nodes=1))
    )
    assert any(
        problem.startswith("model.moe.n_group / routed_scaling_factor: qwen3_moe routes without groups")
        for problem in refusals(gqa, "qwen3_moe")
    )
