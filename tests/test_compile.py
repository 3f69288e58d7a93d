"""`train.compile: blocks`: each transformer block compiled, training as the eager run does."""

import json

import torch

from ferry.portability import compare_runs
from ferry.train import train


def test_compiled_blocks_train_as_the_eager_run_does(make_config, tmp_path):
    steps = "train.steps=12"
    train(make_config(steps, run_dir=tmp_path / "eager"))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    train(make_config(steps, "train.compile=blocks", run_dir=tmp_path / "compiled"))
    # a dense block and a MoE block: two graphs at least (a MoE block breaks around its expert kernel)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2
    verdict = compare_runs(tmp_path / "eager", tmp_path / "compiled", profile="same-hardware")
    assert verdict.passed, verdict
    compiled = json.loads((tmp_path / "compiled" / "run.json").read_text())["compile"]
    assert compiled["mode"] == "blocks" and compiled["regions"] == 2 and compiled["backend"] == "inductor"
    assert "moe.routed_experts=fused_loop@cpu" in compiled["eager_ops"]  # it reads group sizes on the host
    assert json.loads((tmp_path / "eager" / "run.json").read_text())["compile"] == {"mode": "none"}
