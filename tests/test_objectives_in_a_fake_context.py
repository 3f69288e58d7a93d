"""DPO and GRPO trained through a fake step context: an objective needs nothing of a run but the context, its
settings, its data and its reference, so its step is tested on its own, without a trainer."""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from ferry.comm import DistContext
from ferry.comm.reductions import RankReductions
from ferry.data import PrepareSpec, prepare_dataset
from ferry.data.config import DataConfig
from ferry.data.records import RecordLoader
from ferry.inference.generate import generate
from ferry.inference.scoring import ScoringPass
from ferry.model import ModelConfig, Transformer
from ferry.train.objectives.base import RecordTraining
from ferry.train.objectives.config import DPOConfig, GRPOConfig
from ferry.train.objectives.dpo import DPO_STATISTICS, DPOObjective
from ferry.train.objectives.grpo import GRPO_STATISTICS, GRPOObjective
from ferry.train.step_context import ForwardPass
from ferry.train.step_statistics import StepStatistics

CPU = torch.device("cpu")
MODEL = ModelConfig(
    vocab_size=576,
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    max_seq_len=64,
    dense_layers=1,
    dense_ffn_dim=64,
    moe={"num_experts": 4, "top_k": 2, "expert_ffn_dim": 32},
)


class FakeContext:
    """A single process on the CPU: phases and updates are written down, the update is a real AdamW step."""

    def __init__(self, model: torch.nn.Module, lr: float = 1e-2):
        self.model = model
        self.device = CPU
        self.rank, self.world_size = 0, 1
        self.reductions = RankReductions(DistContext(0, 1, 0, None), CPU, sum_tensor=lambda tensor: tensor)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        self.events: list[str] = []
        self.touches = 0

    @contextmanager
    def phase(self, name: str):
        self.events.append(name)
        yield

    def train_passes(self, passes: list[ForwardPass], statistics: StepStatistics) -> None:
        for forward in passes:
            self.events.append("forward")
            output = self.model(
                forward.tokens_BS,
                document_ids_BS=forward.document_ids_BS,
                padding_BS=forward.padding_BS,
                targets=forward.head,
            )
            parts = forward.loss(output)
            self.events.append("backward")
            parts.objective.backward()
            if forward.counted:
                statistics.add(parts, output, forward.share)

    @torch.no_grad()
    def score(self, scoring: ScoringPass, model: torch.nn.Module | None = None) -> torch.Tensor:
        return scoring.reduce((model or self.model)(scoring.tokens_BS, padding_BS=scoring.padding_BS))

    def generate(self, prompts, config, end_ids, row_seeds, progress=None):
        return generate(self.model, prompts, config, end_ids=end_ids, row_seeds=row_seeds, progress=progress)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def update(self, step: int) -> tuple[float, bool]:
        self.events.append(f"update {step}")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0).item()
        self.optimizer.step()
        return norm, True

    def progress(self) -> None:
        self.touches += 1


class FakeReferences:
    """The stage's parent: a frozen copy of the policy as it starts."""

    def __init__(self, policy: torch.nn.Module):
        self.frozen = Transformer(MODEL)
        self.frozen.load_state_dict(policy.state_dict())
        self.built = 0

    def checkpoint(self):
        return type("Parent", (), {"path": Path("parent"), "step": 7})()

    @staticmethod
    def pointer(checkpoint) -> dict:
        return {"checkpoint": str(checkpoint.path), "digest": "d" * 64, "step": checkpoint.step}

    def model(self, checkpoint) -> torch.nn.Module:
        self.built += 1
        return self.frozen.requires_grad_(False).eval()


@pytest.fixture(scope="module")
def records(stdlib_dataset, tmp_path_factory) -> dict[str, Path]:
    tokenizer = str(stdlib_dataset / "tokenizer.json")
    root = tmp_path_factory.mktemp("records")
    for kind in ("preferences", "prompts"):
        prepare_dataset(
            PrepareSpec(embedded="largest", tokenizer=tokenizer, embedded_max_bytes=20_000, records=kind), root / kind
        )
    return {"preferences": root / "preferences", "prompts": root / "prompts"}


def _loader(path: Path, kind: str, global_batch: int) -> RecordLoader:
    return RecordLoader(
        DataConfig(sources=[{"name": kind, "path": str(path)}]), seed=0, global_batch=global_batch, kind=kind
    )


def _statistics(model: Transformer, names: tuple[str, ...]) -> StepStatistics:
    return StepStatistics(len(model.moe_layers()), MODEL.moe.num_experts, CPU, objective=names)


def _dpo(records, tmp_path, policy) -> tuple[DPOObjective, FakeReferences]:
    references = FakeReferences(policy)
    loader = _loader(records["preferences"], "preferences", global_batch=8)
    records = RecordTraining(
        loader, {}, micro_batch=4, moe=MODEL.moe, max_seq_len=64, eval_interval=0, references=references
    )
    objective = DPOObjective(DPOConfig(beta=0.5, score_batch=16), records, tmp_path / "cache", {"model": "tiny"})
    return objective, references


def test_dpo_starts_at_log_2_against_its_own_parent_and_moves_the_chosen_answers_up(records, tmp_path):
    torch.manual_seed(0)
    policy = Transformer(MODEL)
    objective, references = _dpo(records, tmp_path, policy)
    context = FakeContext(policy)
    notes = objective.prepare(context)
    assert references.built == 1 and "computed from parent" in notes[0] and context.touches > 0
    loader = objective.loader
    cursor = loader.new_cursor()
    statistics = _statistics(policy, DPO_STATISTICS)
    outcome = objective.step(context, cursor, statistics)
    figures = objective.figures(statistics, outcome)
    # the policy is its reference: every implicit reward is 0, every pair's loss -log sigmoid(0)
    assert figures["loss"] == pytest.approx(math.log(2), rel=1e-5)
    assert figures["rewards/margin"] == pytest.approx(0.0, abs=1e-6) and figures["rewards/accuracy"] == 0.0
    assert context.events == ["forward", "backward", "forward", "backward", "update 1"]
    assert outcome.stepped and outcome.tokens > 0 and statistics.counts_LE.sum() > 0
    margins = []
    for _ in range(6):
        cursor = loader.advance(cursor)
        statistics = _statistics(policy, DPO_STATISTICS)
        margins.append(objective.figures(statistics, objective.step(context, cursor, statistics))["rewards/margin"])
    assert margins[-1] > 0, "DPO moves the chosen answers above the rejected ones"
    again, references_again = _dpo(records, tmp_path, policy)
    assert "reused from" in again.prepare(FakeContext(policy))[0] and references_again.built == 0


def _grpo(records, policy, verifier: str = "numeric", **settings) -> GRPOObjective:
    config = GRPOConfig(group_size=4, max_new_tokens=3, verifier=verifier, **settings)
    training = RecordTraining(
        _loader(records["prompts"], "prompts", global_batch=4),
        {},
        micro_batch=2,
        moe=MODEL.moe,
        max_seq_len=64,
        eval_interval=0,
        references=FakeReferences(policy),
    )
    return GRPOObjective(config, training, seed=0)


def test_grpo_samples_groups_scores_them_and_trains_on_those_whose_rewards_differ(records, monkeypatch):
    from ferry.train.objectives import verifiers

    torch.manual_seed(0)
    policy = Transformer(MODEL)
    # an untrained model solves nothing: a verifier that accepts completions starting with an even token gives
    # the groups rewards that differ
    monkeypatch.setitem(verifiers.VERIFIERS, "even", lambda text, answer: float(len(text) % 2 == 0))
    objective = _grpo(records, policy, verifier="even", iterations=2)
    assert objective.prepare(FakeContext(policy)) == []  # no KL: the parent is only pointed at
    context = FakeContext(policy, lr=0.1)  # a first update that moves the policy far from the one that sampled
    cursor = objective.loader.new_cursor()
    statistics = _statistics(policy, GRPO_STATISTICS)
    outcome = objective.step(context, cursor, statistics)
    sums = statistics.own.values()
    figures = objective.figures(statistics, outcome)
    assert sums["groups"] == 4 and sums["completions"] == 16
    assert 0 < sums["kept_groups"] <= 4 and 0.0 < figures["reward"] < 1.0
    assert context.events[0] == "generate" and context.events.count("update 1") == 2  # two updates on one rollout
    assert outcome.stepped and outcome.tokens > 0
    assert figures["clip_fraction"] > 0, "the second update's ratios move off 1 and some are clipped"
    # the rollouts of a step are a function of (seed, step, prompt, sample): the same cursor draws the same
    replay = _grpo(records, policy, verifier="even")
    first = replay._rollouts(context, [0, 1], step=0)
    second = replay._rollouts(context, [0, 1], step=0)
    assert [c.tolist() for c in first.completions] == [c.tolist() for c in second.completions]


def test_grpo_skips_the_update_when_every_group_earned_the_same(records, monkeypatch):
    from ferry.train.objectives import verifiers

    torch.manual_seed(0)
    policy = Transformer(MODEL)
    monkeypatch.setitem(verifiers.VERIFIERS, "never", lambda text, answer: 0.0)
    objective = _grpo(records, policy, verifier="never")
    context = FakeContext(policy)
    before = [parameter.detach().clone() for parameter in policy.parameters()]
    statistics = _statistics(policy, GRPO_STATISTICS)
    outcome = objective.step(context, objective.loader.new_cursor(), statistics)
    assert not outcome.stepped and context.events == ["generate"]
    assert statistics.own.values()["kept_groups"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))
