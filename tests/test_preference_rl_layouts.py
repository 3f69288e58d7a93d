"""DPO and GRPO (and SFT) over several ranks: expert parallelism, FSDP and context parallelism each train as one
process does, from the SFT parent and task views of tests/test_preference_rl.py."""

from __future__ import annotations

import pytest
from test_preference_rl import chat_tokenizer, sft, task  # noqa: F401  (the module's fixtures, shared)


@pytest.mark.parametrize("objective", ["dpo", "grpo"])
def test_two_expert_parallel_ranks_train_as_one_process_does(tmp_path, task, sft, objective):
    """Records split over 2 EP ranks: the reference scores, the rollouts (each rank decoding its own prompts in
    step with the other) and the update give the 1-process run's figures."""
    import distributed_training as runs

    from ferry.comm.spawn import run_on_ranks

    data = task["pairs"] if objective == "dpo" else task["prompts"]
    overrides = [
        f"train.objective={objective}",
        f"init_from={sft}",
        f"data.sources=[{{name: d, path: {data}}}]",
        "model.vocab_size=576",
        "data.seq_len=64",
        "train.steps=3",
        "checkpoint.interval=0",
        "optim.lr=1e-3",
        "train.global_batch=8",
        "train.micro_batch=2",
        "grpo.group_size=4",
        "grpo.max_new_tokens=3",
        "grpo.verifier=numeric",
    ]
    single = runs.train_run(str(data), str(tmp_path / "one"), *overrides)
    ranks = run_on_ranks(runs.train_run, 2, str(data), str(tmp_path / "two"), *overrides, "parallel.ep=2")
    assert ranks[0]["losses"] == ranks[1]["losses"]
    if objective == "dpo":
        assert ranks[0]["losses"] == pytest.approx(single["losses"], rel=1e-4, abs=1e-6)
    else:
        # Expert parallelism sums the experts' outputs in another order, so the next layers' router inputs
        # differ in their last bits (z-losses agree to 5e-10) and a near-tie between two experts may go either
        # way (padding is left out of the statistics, so it is not that): one assignment's share of ~1,300
        # moves the balancing loss by 5e-4 relative. Everything else in the loss is compared as for DPO.
        from ferry.model import MoEConfig

        aux_coef = MoEConfig().aux_loss_coef  # the tiny config keeps the default

        def without_balancing(records: list[dict]) -> list[float]:
            return [record["loss"] - aux_coef * record["aux_loss"] for record in records]

        assert without_balancing(ranks[0]["records"]) == pytest.approx(
            without_balancing(single["records"]), rel=1e-4, abs=1e-6
        )
        balancing = [[record["aux_loss"] for record in run["records"]] for run in (ranks[0], single)]
        assert balancing[0] == pytest.approx(balancing[1], rel=1e-3)
    if objective == "grpo":
        assert [r["reward"] for r in ranks[0]["records"]] == [r["reward"] for r in single["records"]]
        assert max(r["reward"] for r in single["records"]) > 0, "nothing trained: the comparison would be empty"
    assert ranks[0]["records"][-1]["moe.ep_imbalance"] >= 1.0


@pytest.mark.parametrize("objective", ["dpo", "grpo"])
def test_dpo_and_grpo_train_under_fsdp_as_one_process_does(tmp_path, task, sft, objective):
    """FSDP over 2 ranks (the layout fuzzer's two findings): the frozen reference is sharded as the policy is,
    so its pieces load and its forwards gather alike (DPO's scores, GRPO's KL penalty); and FSDP gathers a
    block's weights into buffers it gathers into again at the next forward, so a rollout decoded under inference
    mode would make them tensors no later step may update: decoded under no_grad, the run draws the one-process
    rollouts and scores the same rewards."""
    import distributed_training as runs

    from ferry.comm.spawn import run_on_ranks

    data = task["pairs"] if objective == "dpo" else task["prompts"]
    overrides = [
        f"train.objective={objective}",
        f"init_from={sft}",
        f"data.sources=[{{name: d, path: {data}}}]",
        "model.vocab_size=576",
        "data.seq_len=64",
        "train.steps=2",
        "checkpoint.interval=0",
        "optim.lr=1e-3",
        "train.global_batch=8",
        "train.micro_batch=2",
        "grpo.group_size=4",
        "grpo.max_new_tokens=3",
        "grpo.verifier=numeric",
        "grpo.kl_coef=0.05",
    ]
    single = runs.train_run(str(data), str(tmp_path / "one"), *overrides)
    fsdp = run_on_ranks(runs.train_run, 2, str(data), str(tmp_path / "two"), *overrides, "parallel.mode=fsdp")[0]
    assert fsdp["losses"] == pytest.approx(single["losses"], rel=1e-4, abs=1e-6)
    if objective == "grpo":
        assert [r["reward"] for r in fsdp["records"]] == [r["reward"] for r in single["records"]]
        assert fsdp["records"][-1]["kl"] > 0, "the reference scored the rollouts"
    else:
        assert [r["rewards/margin"] for r in fsdp["records"]] == pytest.approx(
            [r["rewards/margin"] for r in single["records"]], rel=1e-4, abs=1e-6
        )


@pytest.mark.parametrize("objective", ["dpo", "sft"])
def test_dpo_and_sft_train_under_context_parallelism_as_one_process_does(tmp_path, task, sft, objective):
    """2 ranks splitting every sequence (chat rows padded to whole chunks): DPO's answer log-probs made whole over
    the ranks before its pair loss, the reference's scored alike; SFT's loss mask split with the positions."""
    import distributed_training as runs

    from ferry.comm.spawn import run_on_ranks

    data = task["pairs"] if objective == "dpo" else task["chat"]
    overrides = [
        f"train.objective={'lm' if objective == 'sft' else objective}",
        f"init_from={sft}",
        f"data.sources=[{{name: d, path: {data}}}]",
        "model.vocab_size=576",
        "data.seq_len=64",
        "train.steps=3",
        "checkpoint.interval=0",
        "optim.lr=1e-3",
        "train.global_batch=8",
        "train.micro_batch=2",
    ]
    single = runs.train_run(str(data), str(tmp_path / "one"), *overrides)
    ranks = run_on_ranks(runs.train_run, 2, str(data), str(tmp_path / "two"), *overrides, "parallel.cp=2")
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert ranks[0]["losses"] == pytest.approx(single["losses"], rel=1e-5)
    if objective == "dpo":  # a margin starts at zero (policy = reference): compared to the log-probs' last bits
        for key in ("rewards/margin", "logps/chosen"):
            assert [r[key] for r in ranks[0]["records"]] == pytest.approx(
                [r[key] for r in single["records"]], rel=1e-5, abs=1e-6
            )
