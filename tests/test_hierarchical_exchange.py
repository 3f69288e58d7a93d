"""The two-stage expert exchange (`parallel.ep_topology`) in whole runs: 4 CPU ranks as 2 simulated nodes of 2, the
experts split over all 4 (the exchange itself, byte for byte against the routing: tests/test_parallel.py).

Tolerance: the hierarchical exchange sums a token's expert outputs per node, then over nodes, where the flat one
sums them in one go; the rest of the step is the same, so the losses agree as two layouts do (1e-5 relative,
tests/test_distributed_training.py)."""

from __future__ import annotations

import itertools
import math

import distributed_training as runs
import pytest

from ferry.comm.spawn import run_on_ranks
from ferry.config import ConfigError, UserError
from ferry.train.layouts import RunLayout
from ferry.train.layouts.expert_resident import expected_nodes

LAYOUT_TOLERANCE = 1e-5
TWO_NODES = ("parallel.ep=4", "parallel.ranks_per_node=2", "train.micro_batch=2", "train.steps=4")


def _relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_a_hierarchical_run_trains_as_the_flat_one_with_zero_and_recompute(stdlib_dataset, tmp_path):
    """The same losses as the flat exchange, with ZeRO-1 and selective recompute; the recompute issues no exchange
    again (the same bytes a step as without it); the step record counts what crossed each tier."""

    def run(name: str, *overrides: str) -> list[dict]:
        ranks = run_on_ranks(runs.train_run, 4, str(stdlib_dataset), str(tmp_path / name), *TWO_NODES, *overrides)
        return ranks[0]["records"]

    zero_recompute = ("optim.zero=true", "train.activation_checkpointing=selective")
    flat = run("flat", "parallel.ep_topology=flat", *zero_recompute)
    hierarchical = run("hierarchical", *zero_recompute)  # auto: the EP group spans the two nodes
    plain = run("plain", "parallel.ep_topology=hierarchical", "optim.zero=true")
    assert _relative([r["loss"] for r in hierarchical], [r["loss"] for r in flat]) < LAYOUT_TOLERANCE
    assert _relative([r["loss"] for r in plain], [r["loss"] for r in flat]) < LAYOUT_TOLERANCE
    for key in ("comm_bytes", "inter_node_bytes", "intra_node_bytes"):
        assert [r[key] for r in hierarchical] == [r[key] for r in plain], key
    for records in (flat, hierarchical):
        assert all(r["inter_node_bytes"] > 0 and r["intra_node_bytes"] > 0 for r in records)
        assert all(r["inter_node_comm_s"] > 0 and r["intra_node_comm_s"] >= 0 for r in records)
        assert all(r["inter_node_bytes"] + r["intra_node_bytes"] < r["comm_bytes"] for r in records), "own rows"


def test_auto_chooses_by_the_layout_and_says_why(make_config):
    across = make_config(*TWO_NODES, "train.global_batch=8")
    layout = across.check_world_size(4)
    assert layout.ep_topology == "hierarchical" and layout.record()["ep_topology"] == "hierarchical"
    assert RunLayout.of(across).announcements(across, layout) == [
        "ferry: ep_topology auto: hierarchical (the EP group of 4 ranks spans 2 nodes of 2)"
    ]
    inside = make_config("parallel.ep=2", "parallel.ranks_per_node=2", "train.micro_batch=2", "train.global_batch=8")
    layout = inside.check_world_size(4)
    assert layout.ep_topology == "flat" and "ep_topology" not in layout.record()
    assert RunLayout.of(inside).announcements(inside, layout) == [
        "ferry: ep_topology auto: flat (hierarchical needs an EP group of more than one whole node (parallel.ep 2 "
        "lies inside one node))"
    ]
    chunked = make_config(*TWO_NODES, "parallel.ep_overlap=chunked")
    layout = chunked.check_world_size(4)
    assert layout.ep_topology == "flat"
    assert "ep_overlap chunked, ep_dispatch permuted shape the flat exchange" in "".join(
        RunLayout.of(chunked).announcements(chunked, layout)
    )
    assert make_config("parallel.ep=4", "train.micro_batch=2").check_world_size(4).ep_topology == "flat"
    top_1 = make_config(*TWO_NODES, "model.moe.top_k=1")
    layout = top_1.check_world_size(4)
    assert layout.ep_topology == "flat"
    assert "model.moe.top_k 1 sends each token at most once a node" in "".join(
        RunLayout.of(top_1).announcements(top_1, layout)
    )
    chosen = make_config(*TWO_NODES, "model.moe.top_k=1", "parallel.ep_topology=hierarchical")
    assert chosen.check_world_size(4).ep_topology == "hierarchical"  # named, it runs: it trains as the flat one


def test_a_hierarchical_exchange_it_cannot_run_is_refused_by_name(make_config):
    with pytest.raises(UserError, match=r"parallel.ep_topology: hierarchical needs an EP group of more than one whole"):
        make_config("parallel.ep=4", "parallel.ep_topology=hierarchical", "train.micro_batch=2").check_world_size(4)
    with pytest.raises(ConfigError, match=r"ep_topology hierarchical runs its two stages in one piece"):
        make_config(*TWO_NODES, "parallel.ep_topology=hierarchical", "parallel.ep_dispatch=rowwise")


def test_the_predicted_traffic_crosses_nodes_on_the_rail_and_forwards_inside_the_node(make_config):
    config = make_config(*TWO_NODES)
    layout = config.check_world_size(4)
    traffic = {t.op: t for t in RunLayout.of(config).traffic(config, layout, 2)}
    assert {traffic[op].tier for op in ("ep_dispatch", "ep_combine", "ep_routes", "ep_counts")} == {"inter_node"}
    assert {t.tier for op, t in traffic.items() if op.startswith("ep_node")} == {"intra_node"}
    tokens, calls = 2 * 32, 1  # a micro-batch of 2 sequences of 32 on a rank, once a step (8 / 4 ranks), 1 MoE layer
    sent = tokens * expected_nodes(4, 2, 2, None)
    assert traffic["ep_dispatch"].bytes == pytest.approx(calls * sent * (32 + 2) * 4)
    assert traffic["ep_routes"].bytes == pytest.approx(calls * sent * 2 * 4)


@pytest.mark.parametrize("experts, nodes, top_k, max_nodes", [(4, 2, 2, None), (16, 4, 3, None), (16, 4, 4, 2)])
def test_the_expected_nodes_a_token_reaches_are_counted_over_every_choice_of_experts(experts, nodes, top_k, max_nodes):
    """Balanced routing: every set of top_k experts among those of the nodes a token may reach alike."""
    per_node = experts // nodes
    reached = min(max_nodes or nodes, nodes)
    choices = list(itertools.combinations(range(reached * per_node), top_k))
    mean = sum(len({expert // per_node for expert in chosen}) for chosen in choices) / len(choices)
    assert expected_nodes(experts, nodes, top_k, max_nodes) == pytest.approx(mean, rel=1e-12)
    assert math.isclose(expected_nodes(experts, nodes, 1, None), 1.0)
