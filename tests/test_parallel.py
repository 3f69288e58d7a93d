"""Expert parallelism, ZeRO-1 and failure handling on 2 CPU processes with gloo."""

import distributed_cases as cases
import pytest
import torch

from ferry.comm.spawn import RankFailure, run_on_ranks


def test_ep2_dispatch_equals_local_experts_forward_and_backward():
    for output_error, input_grad_error, local_experts, ops in run_on_ranks(
        cases.dispatcher_matches_local_experts, 2, 2
    ):
        assert output_error < 1e-5 and input_grad_error < 1e-5
        assert local_experts == 4, "each EP rank keeps half the experts"
        assert {"ep_counts", "ep_dispatch", "ep_combine", "ep_dispatch_backward", "ep_combine_backward"} <= ops


def test_zero1_equals_adamw_and_holds_a_share_of_the_state():
    results = run_on_ranks(cases.zero_equals_adamw, 2, 4)
    for difference, _, _ in results:
        assert difference < 1e-6
    held = [state for _, state, _ in results]
    full = results[0][2]
    assert sum(held) == full, "every moment is held by exactly one rank"
    assert max(held) < 0.75 * full


def test_a_bad_layout_is_reported_by_every_rank():
    with pytest.raises(RankFailure) as caught:
        run_on_ranks(cases.bad_layout_raises, 2, 2, timeout_s=120)
    message = str(caught.value)
    assert "rank 0" in message and "rank 1" in message
    assert message.count("parallel.ep: 2 does not divide model.moe.num_experts (3)") == 2


def test_a_failing_rank_is_named_and_nothing_hangs():
    with pytest.raises(RankFailure) as caught:
        run_on_ranks(cases.rank_one_raises, 2, timeout_s=90)
    message = str(caught.value)
    assert "rank 1" in message and "rank one is broken" in message


@pytest.mark.parametrize("mode, ep", [("ep", 2), ("ep", 1), ("fsdp", 1)])
def test_the_whole_model_under_each_layout_equals_one_process(mode, ep):
    for logits_error, worst_grad_error in run_on_ranks(cases.model_ep_equals_single, 2, mode, ep):
        assert logits_error < 1e-5
        assert worst_grad_error < 1e-5


def test_a_chunked_exchange_takes_every_expert_row_once_in_order():
    """Part k takes the k-th share of each expert's rows; together the parts take every row exactly once, and
    within a part the rows stay sorted by expert (so each destination rank's rows are contiguous)."""
    from ferry.parallel.expert_parallel import _chunk_rows

    generator = torch.Generator().manual_seed(0)
    for chunks in (2, 3, 4):
        tokens_per_expert_E = torch.randint(0, 7, (8,), generator=generator)
        tokens_per_expert_E[3] = 0
        counts_KE, rows_K = _chunk_rows(tokens_per_expert_E, chunks)
        assert torch.equal(counts_KE.sum(0), tokens_per_expert_E)
        assert torch.equal(torch.cat(rows_K).sort().values, torch.arange(int(tokens_per_expert_E.sum())))
        expert_of_row_N = torch.repeat_interleave(torch.arange(8), tokens_per_expert_E)
        for counts_E, rows_M in zip(counts_KE, rows_K):
            assert torch.equal(expert_of_row_N[rows_M], torch.repeat_interleave(torch.arange(8), counts_E))


@pytest.mark.parametrize("node_size, top_k", [(2, 4), (1, 4), (2, 1)], ids=["2x2-top4", "4x1-top4", "2x2-top1"])
def test_the_hierarchical_exchange_equals_the_flat_one_and_crosses_nodes_once_per_token_and_node(node_size, top_k):
    """4 ranks as simulated nodes: outputs and every gradient equal to the flat exchange's (fp32, the sums in
    another order), and the bytes between nodes those the routing says: the flat exchange sends a row for each of
    a token's experts on another node, the hierarchical one a row (its values and K weights, and K int32 expert ids)
    for each other node it reaches; inside the node only the forwarded rows move."""
    dim, value = 16, 4
    for errors, sent, remote_slots, remote_nodes in run_on_ranks(
        cases.hierarchical_exchange_equals_flat, 4, node_size, top_k
    ):
        assert max(errors.values()) < 1e-5, errors
        flat, hierarchical = sent["flat"], sent["hierarchical"]
        assert flat["ep_dispatch"].get("inter_node", 0) == remote_slots * dim * value
        assert flat["ep_combine_backward"].get("inter_node", 0) == remote_slots * dim * value
        assert hierarchical["ep_dispatch"].get("inter_node", 0) == remote_nodes * (dim + top_k) * value
        assert hierarchical["ep_routes"].get("inter_node", 0) == remote_nodes * top_k * 4
        assert hierarchical["ep_combine_backward"].get("inter_node", 0) == remote_nodes * dim * value
        assert all("inter_node" not in tiers for op, tiers in hierarchical.items() if op.startswith("ep_node"))
        assert all("intra_node" not in tiers for op, tiers in hierarchical.items() if not op.startswith("ep_node"))
        if top_k == 1:  # a token reaches one expert: the rows that cross are the same, the weights and ids added
            assert remote_nodes == remote_slots
        else:
            assert remote_nodes < remote_slots, "some token has two experts on one other node"
