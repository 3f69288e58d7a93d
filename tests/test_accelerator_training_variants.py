"""benchmarks/accelerator_training.py's variants as `ferry train` overrides, its arguments, and a traced run on a CPU:
a device call that finds a variant misconfigured has spent its scarce minutes on nothing."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from ferry.config.loader import parse_override

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
EAGER = ("portable", "auto", "fp8-emulated", "fp8-native", "fp8-torchao", "chunked-loss", "large-micro-eager")
AUTO_MICRO = ("large-micro", "large-micro-eager", "fp8-torchao-compiled")


@pytest.fixture(scope="module")
def harness():
    path = REPO / "benchmarks" / "accelerator_training.py"
    spec = importlib.util.spec_from_file_location("accelerator_training", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(harness, data="data", shape: str = "olmoe-1b-7b", batch: int | None = 2, steps: int | None = None):
    return argparse.Namespace(
        data=str(data),
        shape=shape,
        steps=steps or harness.WARMUP_STEPS + 2,
        batch=batch,
        device="cpu",
        set=TINY,
        dir=None,
        trace=None,
    )


def _train_keys(harness, name: str, **kwargs) -> dict:
    settings = harness.settings(harness.VARIANTS[name], _args(harness, **kwargs), Path("run"))
    return {key.removeprefix("train."): value for key, value in settings.items() if key.startswith("train.")}


def test_eager_variants_say_so_now_that_ferry_compiles_by_default_on_gpus(harness):
    for name in harness.VARIANTS:
        expected = "none" if name in EAGER else "blocks"
        assert harness.VARIANTS[name]["train.compile"] == expected, name


def test_each_new_variant_has_the_keys_its_description_gives(harness):
    variants = harness.VARIANTS
    assert variants["checkpointed"] == {**variants["compiled"], "train.activation_checkpointing": "selective"}
    assert variants["checkpointed-full"] == {**variants["compiled"], "train.activation_checkpointing": "full"}
    assert variants["large-micro"] == {
        **variants["checkpointed-full"],
        "train.loss_chunk": 4096,
        "train.micro_batch": "auto",
    }
    assert variants["large-micro-eager"] == {**variants["large-micro"], "train.compile": "none"}
    assert variants["fp8-torchao-compiled"] == {
        **variants["fp8-torchao"],
        **variants["large-micro"],
        "train.compile": "blocks",
    }


def test_auto_micro_batch_variants_are_not_given_a_number(harness):
    for name in harness.VARIANTS:
        train = _train_keys(harness, name)
        assert train["global_batch"] == 16, name  # --batch 2 times the shape's 8 micro-batches: the same for all
        assert train["micro_batch"] == ("auto" if name in AUTO_MICRO else 2), name


def test_every_setting_reads_back_as_the_override_it_means(harness, tmp_path):
    settings = harness.settings(harness.VARIANTS["fp8-torchao-compiled"], _args(harness), tmp_path, traced=True)
    step = harness.WARMUP_STEPS + 1
    overrides = [parse_override(f"{key}={value}") for key, value in settings.items()]
    parsed = {tuple(keys): value for keys, value in overrides}
    assert parsed[("profile", "torch_trace")] == [step, step]
    assert parsed[("kernels", "ops", "moe.fp8_grouped_mm")] == "torchao"
    assert parsed[("train", "micro_batch")] == "auto" and parsed[("train", "compile")] == "blocks"
    untraced = harness.settings(harness.VARIANTS["compiled"], _args(harness), tmp_path)
    assert "profile.torch_trace" not in untraced


def test_the_traced_variant_must_run_and_have_a_step_left_to_measure(harness, capsys):
    argv = ["--data", "d", "--variants", "auto,large-micro", "--trace", "large-micro", "--steps", "10"]
    args = harness.parse_args(argv)
    assert args.variants == ["auto", "large-micro"] and args.trace == "large-micro"
    for argv, complaint in (
        (["--variants", "auto", "--trace", "large-micro"], "not among --variants"),
        (["--variants", "auto", "--trace", "auto", "--steps", str(harness.WARMUP_STEPS + 1)], "with --trace"),
        (["--variants", "auto,bogus"], "variants are"),
    ):
        with pytest.raises(SystemExit) as exit_:
            harness.parse_args(["--data", "d", *argv])
        assert exit_.value.code == 2 and complaint in capsys.readouterr().err


@pytest.mark.parametrize(
    ("run", "expected"),
    [
        ({"micro_batch": {"requested": 2, "chosen": 2}}, 2),
        ({"micro_batch": {"requested": "auto", "chosen": 8, "estimate_gib": 128.9}}, 8),
        ({"config": {"train": {"micro_batch": 4}}}, None),
        ({}, None),
    ],
)
def test_the_micro_batch_used_is_read_wherever_run_json_records_it(harness, run, expected):
    assert harness.micro_batch_used(run) == expected


def test_the_fp8_approval_ratio_compares_against_large_micro(harness):
    results = {
        "large-micro": {"tokens_per_s": 100.0},
        "fp8-torchao-compiled": {"tokens_per_s": 115.0},
        "compiled": {"tokens_per_s": 80.0},
        "checkpointed": {"failed": "out of memory"},
    }
    ratios = harness.ratios(results)
    assert ratios["fp8_torchao_compiled_vs_large_micro"] == pytest.approx(1.15)
    assert ratios["large_micro_vs_compiled"] == pytest.approx(1.25)
    assert ratios["checkpointed_vs_compiled"] is None


def test_a_traced_variant_summarises_its_trace_and_leaves_that_step_out(harness, stdlib_dataset, tmp_path):
    """On a CPU the trace holds host events only: the summary has a window and no kernels."""
    args = _args(harness, data=stdlib_dataset, shape="mid", steps=harness.WARMUP_STEPS + 2)
    result = harness.run_variant("chunked-loss", harness.VARIANTS["chunked-loss"], args, tmp_path, traced=True)
    assert "failed" not in result, result.get("failed")
    trace = result["trace"]
    assert "failed" not in trace, trace.get("failed")
    assert trace["window_ms"] > 0 and trace["launches"] == 0
    assert result["micro_batch"] == 2 and result["compile"] == "none"
    records = [json.loads(line) for line in (tmp_path / "chunked-loss" / "metrics.jsonl").read_text().splitlines()]
    assert result["step_s"] == next(record["step_s"] for record in records if record["step"] == args.steps)
    assert "no GPU kernels" in harness.describe_trace("chunked-loss", trace)
