"""Hooks a user adds from Python: `train(config, hooks=[...])` calls them at the named points, and what a hook
adds to a step's record is written with it."""

from __future__ import annotations

import json

from ferry.train import Hook, RunEnd, train


class ExpertLoadSpread(Hook):
    """The example of docs/runs.md: a custom figure in every step record (the spread between the busiest and the
    idlest expert of the first MoE layer), and what the run passed through, point by point."""

    def __init__(self):
        self.points: list[tuple] = []

    def before_training(self) -> None:
        self.points.append(("before_training",))

    def before_step(self, step: int) -> None:
        self.points.append(("before_step", step))

    def after_backward(self, step: int, model) -> None:
        self.points.append(("after_backward", step, any(p.grad is not None for p in model.parameters())))

    def after_step(self, step: int, record: dict) -> None:
        loads = record["moe.tokens_per_expert"][0]
        record["custom.expert_load_spread"] = max(loads) - min(loads)
        self.points.append(("after_step", step, "eval.loss" in record))

    def after_training(self, step: int) -> None:
        self.points.append(("after_training", step))

    def at_close(self, end: RunEnd | None) -> None:
        self.points.append(("at_close", end.step if end else None))


def test_a_users_hook_sees_every_point_and_its_figure_reaches_the_record(make_config, stdlib_dataset):
    hook = ExpertLoadSpread()
    config = make_config(
        "train.steps=2",
        f"eval.sources=[{{name: held_out, path: {stdlib_dataset}}}]",
        "eval.interval=2",
        "eval.batches=1",
    )
    result = train(config, hooks=[hook])
    assert hook.points == [
        ("before_training",),
        ("before_step", 1),
        ("after_backward", 1, True),
        ("after_step", 1, False),
        ("before_step", 2),
        ("after_backward", 2, True),
        ("after_step", 2, True),  # after the evaluation
        ("after_training", 2),
        ("at_close", 2),
    ]
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    spreads = [record["custom.expert_load_spread"] for record in records]
    assert spreads == [max(r["moe.tokens_per_expert"][0]) - min(r["moe.tokens_per_expert"][0]) for r in records]
