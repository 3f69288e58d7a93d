"""Low-precision expert GEMMs in a real training run, and their record in run.json."""

import json

import pytest

from ferry.train import Trainer, train

# MXFP8 keeps E4M3's 3 mantissa bits per element with a power-of-two scale per 32 values:
# each operand is off by at most ~6%, errors that average out over the GEMM's reductions.
# Published MXFP8 pre-training tracks BF16 within about 0.5% of loss; 1% leaves room for
# the tiny model's noisier steps, and is still ten times tighter than the loss drop itself.
LOW_PRECISION_TOLERANCE = 0.01


@pytest.mark.parametrize("recipe", ["mxfp8"])
def test_the_tiny_config_trains_with_low_precision_experts_close_to_fp32(make_config, tmp_path, recipe):
    reference = train(make_config("train.steps=30", run_dir=tmp_path / "fp32")).losses
    low = train(make_config("train.steps=30", f"precision.experts={recipe}", run_dir=tmp_path / recipe)).losses
    assert low != reference, "the expert operands are actually rounded"
    assert abs(low[-1] - reference[-1]) / reference[-1] < LOW_PRECISION_TOLERANCE
    assert low[-1] < 0.95 * low[0], "and the run still learns"
    record = json.loads((tmp_path / recipe / "run.json").read_text())
    assert record["precision"]["experts"] == recipe and record["precision"]["experts_mode"] == "emulated"
    assert f"inside moe.{recipe}_grouped_mm portable" in record["kernels"]["ops"]["moe.grouped_mm"]["reason"]
    assert record["precision"]["experts_kernel"] == "portable"


def test_unsupported_low_precision_can_be_refused(make_config):
    from ferry.config import UserError

    with pytest.raises(UserError, match="precision.experts: mxfp8 is not supported natively"):
        Trainer(make_config("precision.experts=mxfp8", "precision.on_unsupported=error"))


def test_the_kernel_choice_is_logged_and_recorded(make_config, tmp_path, capsys):
    train(make_config("train.steps=1", 'kernels.ops."moe.grouped_mm"=portable', run_dir=tmp_path))
    assert "kernels: policy auto" in capsys.readouterr().out
    kernels = json.loads((tmp_path / "run.json").read_text())["kernels"]
    assert kernels["ops"]["moe.grouped_mm"]["implementation"] == "portable"
    assert set(kernels["ops"]) >= {"moe.permute", "moe.combine", "moe.grouped_mm", "norm.rms", "attention"}
