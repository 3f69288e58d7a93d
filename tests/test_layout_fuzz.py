"""The layout fuzzer: a fixed sample of combinations (the CI's) is refused by name or equals its one-process oracle
step by step, resumed in another layout too; the oracle runs once for the combinations that share it; a planted
bug (one rank drops its expert gradients after their reduction) is reported as a divergence with the command
that reproduces it; draws replay from (seed, index)."""

from __future__ import annotations

import json
import os
import re
import textwrap

import pytest

from ferry.portability.fuzz.data import prepare_fuzz_data
from ferry.portability.fuzz.report import summary
from ferry.portability.fuzz.runner import Fuzzer
from ferry.portability.fuzz.space import draw, named

COMPUTATION = "objective=sft precision=bf16 experts=biased-clamped"  # SFT's loss mask, bf16, GPT-OSS's experts
SAMPLE = [  # one computation in three layouts, each resumed in another; and a refusal
    (
        f"{COMPUTATION} world=2 parallel=ep-zero recompute=selective ep_exchange=chunked",
        "world=2 parallel=ep-zero ep_exchange=hierarchical",  # two simulated nodes of one rank, a token sent once
    ),
    (f"{COMPUTATION} world=2 parallel=fsdp recompute=full", "world=1"),
    (f"{COMPUTATION} world=2 parallel=pp schedule=gpipe ep_exchange=rowwise", "world=2 parallel=ep"),
    ("world=1 parallel=cp", "world=1"),
    ("objective=grpo world=2 parallel=fsdp", "world=2 parallel=ep"),  # from an SFT parent, by the seeds' spread
]


@pytest.fixture(scope="module")
def fuzz_data(stdlib_dataset, tmp_path_factory):
    return prepare_fuzz_data(tmp_path_factory.mktemp("fuzz-data"), stdlib_dataset)


@pytest.fixture(scope="module")
def fuzzer(fuzz_data, tmp_path_factory):
    return Fuzzer(tmp_path_factory.mktemp("fuzz"), fuzz_data)


def test_the_ci_sample_is_refused_by_name_or_equal_to_its_oracle_and_resumes_in_another_layout(fuzzer):
    outcomes = [fuzzer.judge(named(drawn), named(resume)) for drawn, resume in SAMPLE]
    verdicts = [outcome.verdict for outcome in outcomes]
    assert verdicts == ["equal", "equal", "equal", "refused", "equal"], summary(outcomes, 0, 0)
    assert "parallel.cp" in outcomes[3].detail
    ran = [*outcomes[:3], outcomes[4]]
    assert all(outcome.resumed_in is not None and len(outcome.commands) == 2 for outcome in ran)
    assert outcomes[1].resumed_in.world == 1, "resumed on one process from two ranks' checkpoint"
    oracles = sorted(path.name for path in (fuzzer.work / "oracles").iterdir())
    assert len(oracles) == 4 and sum("-seed-" in name for name in oracles) == 2, "one oracle for the three; GRPO's "
    "with its two seed runs"
    judged = json.loads(
        (fuzzer.work / "runs" / outcomes[4].combination.digest() / "judged" / "compare-reward.json").read_text()
    )
    assert judged["profile"] == "sampled" and judged["seed_spread"] > 0 and judged["passed"]
    text = summary(outcomes, 60, 0)
    assert text.startswith("seed 0: 5 distinct combinations in 1.0 min: 4 equal, 1 refused, 0 diverged, 0 crashed")


def test_a_planted_bug_is_reported_as_a_divergence_with_the_command_that_reproduces_it(fuzz_data, tmp_path):
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(
        textwrap.dedent('''
        """A bug planted in every process started with this directory first on its path: after the expert
        gradients' reduction, rank 1 drops its own (halving them would not do: AdamW does not see a scale)."""
        import torch.distributed as dist
        import ferry.parallel.strategies as strategies

        reduce = strategies.reduce_gradients

        def dropped_on_rank_1(params, collectives, reduce_dtype, bucket):
            reduce(params, collectives, reduce_dtype, bucket)
            if dist.is_initialized() and dist.get_rank() == 1:
                for param in params:
                    if param.grad is not None and param.ndim == 3:
                        param.grad.zero_()

        strategies.reduce_gradients = dropped_on_rank_1
    ''')
    )
    planted = Fuzzer(tmp_path / "work", fuzz_data, env={**os.environ, "PYTHONPATH": str(plant)})
    outcome = planted.judge(named("world=2 parallel=ep"), named("world=1"))
    assert outcome.verdict == "diverged", outcome.detail
    assert re.match(
        r"step [2-6]: outside the layout bound, relative difference \d\.\d\de-\d\d at most \(step [2-6], "
        r"loss\)",
        outcome.detail,
    ), outcome.detail
    assert "--nproc 2" in outcome.commands[0] and "parallel.ep=2" in outcome.commands[0]
    assert f"diverged: {outcome.combination.describe()}" in summary([outcome], 1, 0)


def test_draws_replay_from_seed_and_index_and_name_every_axis():
    assert draw(7, 3) == draw(7, 3) and draw(7, 3) != draw(7, 4)
    assert named(draw(7, 3).describe()) == draw(7, 3)
    with pytest.raises(ValueError, match="unknown axes"):
        named("worlds=2")
