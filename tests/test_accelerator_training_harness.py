"""benchmarks/accelerator_training.py, the harness of the device check's training stages, run on a CPU at a tiny
size: the device time it gets is short and scarce, so its own faults must show here, not there."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

TINY = [
    "model.vocab_size=512",
    "model.dim=32",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.dense_ffn_dim=64",
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.expert_ffn_dim=32",
    "data.seq_len=32",
    "model.max_seq_len=32",
]


@pytest.fixture(scope="module")
def harness():
    path = REPO / "benchmarks" / "accelerator_training.py"
    spec = importlib.util.spec_from_file_location("accelerator_training", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(harness, dataset, shape: str = "mid") -> argparse.Namespace:
    return argparse.Namespace(
        data=str(dataset), shape=shape, steps=harness.WARMUP_STEPS + 2, batch=2, device="cpu", set=TINY, dir=None
    )


def test_a_variant_reports_its_medians_and_saves_no_checkpoint(harness, stdlib_dataset, tmp_path):
    """A run of the OLMoE shape would end by saving ~80 GB of train state (fp32 weights and AdamW moments) to a
    64 GiB disk."""
    result = harness.run_variant(
        "chunked-loss", harness.VARIANTS["chunked-loss"], _args(harness, stdlib_dataset), tmp_path
    )
    assert "failed" not in result, result.get("failed")
    assert result["tokens_per_s"] > 0 and 0 < result["mfu"] < 1 and result["mem_peak_mib"] > 0
    assert result["step_s"] >= result["forward_s"] + result["backward_s"] > 0
    assert not any(tmp_path.rglob("checkpoints")), "the benchmark run saved a checkpoint"
    line = harness.describe("chunked-loss", result)
    assert "tok/s" in line and "FAILED" not in line


def test_a_variant_that_cannot_run_is_reported_with_ferrys_reason(harness, stdlib_dataset, tmp_path):
    result = harness.run_variant(
        "fp8-torchao", harness.VARIANTS["fp8-torchao"], _args(harness, stdlib_dataset), tmp_path
    )
    assert "torchao" in result["failed"] and "cpu" in result["failed"]
    assert harness.ratios({"fp8-torchao": result, "fp8-native": {"tokens_per_s": 1.0}})["fp8_torchao_vs_native"] is None
