"""What the layout kinds say a step sends (`LayoutKind.traffic`, what a planner asks) is what ferry's collectives
count on CPU ranks: the expert exchanges call for call and byte for byte (each rank's routed rows out, the same
rows' gradients back; what a rank receives varies with the routing, their sum over the ranks does not), ZeRO-1's
broadcasts of every parameter a step, and the gradients' all-reduce, beside which the step's other reductions (its
statistics, the gradient norm) are small."""

from __future__ import annotations

import distributed_training as runs
import pytest

from ferry.comm.spawn import run_on_ranks
from ferry.config import UserError
from ferry.train import RunConfig
from ferry.train.layouts import RunLayout

EXACT_PER_RANK = ("ep_counts", "ep_dispatch", "ep_combine_backward")  # this rank's own rows, whatever the routing
EXACT_SUMMED = ("ep_combine", "ep_dispatch_backward")  # the rows a rank received: their sum over the ranks


def _predicted(config: RunConfig) -> dict[str, tuple[float, float]]:
    layout = config.check_world_size(2)
    predicted: dict[str, tuple[float, float]] = {}
    for traffic in RunLayout.of(config).traffic(config, layout, config.train.micro_batch):
        calls, total = predicted.get(traffic.op, (0, 0.0))
        predicted[traffic.op] = (calls + traffic.calls, total + traffic.bytes)
    return predicted


@pytest.mark.parametrize("layout", [("parallel.ep=2",), ("parallel.ep=2", "optim.zero=true")], ids=["ep2", "ep2-zero"])
def test_a_steps_collectives_are_what_the_kinds_say(stdlib_dataset, tmp_path, layout):
    ranks = run_on_ranks(runs.train_counting_bytes, 2, str(stdlib_dataset), str(tmp_path), "train.steps=2", *layout)
    config = RunConfig.model_validate(ranks[0]["config"])
    predicted = _predicted(config)
    measured = [rank["last_step"] for rank in ranks]
    for op in EXACT_PER_RANK:
        for rank in measured:
            assert rank[op] == (predicted[op][0], predicted[op][1]), op
    for op in EXACT_SUMMED:
        assert sum(rank[op][1] for rank in measured) == 2 * predicted[op][1], op
        assert all(rank[op][0] == predicted[op][0] for rank in measured), op
    for rank in measured:
        reduced = rank["all_reduce"][1]
        assert predicted["all_reduce"][1] <= reduced <= 1.05 * predicted["all_reduce"][1] + 16_384
        if "optim.zero=true" in layout:
            assert rank["broadcast"][1] == predicted["broadcast"][1]
        else:
            assert "broadcast" not in predicted


def test_each_collective_crosses_the_tier_its_group_spans(make_config):
    """Two nodes of two ranks (simulated): an expert exchange over 2 ranks stays inside a node and the dense
    gradients' all-reduce over all 4 crosses between them; over 4 ranks the flat exchange crosses too, and the two-stage
    one crosses only in its stage over the rail."""
    inside = make_config("parallel.ep=2", "parallel.ranks_per_node=2", "train.global_batch=8", "train.micro_batch=2")
    layout = inside.check_world_size(4)
    assert (layout.nodes, layout.record()["nodes"]) == (2, 2)
    tiers = {(t.op, t.group): t.tier for t in RunLayout.of(inside).traffic(inside, layout, 2)}
    assert tiers[("ep_dispatch", "ep")] == "intra_node"
    assert tiers[("all_reduce", "replicas")] == "inter_node" and tiers[("all_reduce", "dp")] == "inter_node"
    across = ("parallel.ep=4", "parallel.ranks_per_node=2", "train.global_batch=8", "train.micro_batch=2")
    flat = make_config(*across, "parallel.ep_topology=flat")
    tiers = {(t.op, t.group): t.tier for t in RunLayout.of(flat).traffic(flat, flat.check_world_size(4), 2)}
    assert tiers[("ep_dispatch", "ep")] == "inter_node"
    two_stage = make_config(*across)  # auto: the exchange spans nodes of several ranks, so it goes in two stages
    tiers = {
        (t.op, t.group): t.tier for t in RunLayout.of(two_stage).traffic(two_stage, two_stage.check_world_size(4), 2)
    }
    assert tiers[("ep_dispatch", "ep_rail")] == "inter_node" and tiers[("ep_node_dispatch", "ep_node")] == "intra_node"
    assert ("ep_dispatch", "ep") not in tiers
    one_node = make_config("parallel.ep=4", "train.global_batch=8", "train.micro_batch=2")
    layout = one_node.check_world_size(4)
    assert layout.nodes == 1 and "nodes" not in layout.record()
    assert {t.tier for t in RunLayout.of(one_node).traffic(one_node, layout, 2)} == {"intra_node"}


def test_nodes_that_do_not_split_the_job_are_refused(make_config):
    with pytest.raises(UserError, match=r"parallel.ranks_per_node: 3 does not split the world size 4 into whole nodes"):
        make_config("parallel.ranks_per_node=3", "train.global_batch=8", "train.micro_batch=2").check_world_size(4)
