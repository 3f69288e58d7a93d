"""`train.compile: blocks`: each transformer block compiled, training as the eager run does."""

import json

import pytest
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
    assert json.loads((tmp_path / "eager" / "run.json").read_text())["compile"] == {"mode": "none", "requested": "auto"}


def test_a_compiled_block_on_the_sync_free_expert_path_trains_in_float32(make_config, tmp_path):
    """The portable experts on torch's grouped GEMM (what an accelerator runs) compile around the GEMM: its
    shape function takes bfloat16 only, so in float32 it runs eagerly between the compiled parts."""
    sync_free = ('kernels.ops."moe.routed_experts"=portable', 'kernels.ops."moe.grouped_mm"=torch_grouped_mm')
    eager = train(make_config("train.steps=3", *sync_free, run_dir=tmp_path / "eager"))
    compiled = train(make_config("train.steps=3", *sync_free, "train.compile=blocks", run_dir=tmp_path / "compiled"))
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-5)  # fused elementwise work: rounding only
