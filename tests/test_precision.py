"""Precision: FP8/MX rounding and scales, loss scaling, profile-driven policy, low-precision GEMMs."""

import pytest
import torch

from ferry.config import UserError
from ferry.kernels.portable.low_precision import EmulatedLowPrecisionGroupedMM
from ferry.platform.hardware import load_profile, profile_names
from ferry.precision import LossScaler, PrecisionConfig, resolve_precision
from ferry.precision.config import LossScalingConfig
from ferry.precision.formats import fake_quantize_mx, fake_quantize_rowwise, float_format, mx_scale_exponents

E4M3 = float_format("float8_e4m3fn")
E5M2 = float_format("float8_e5m2")


def _mx_error_bound(x_XL: torch.Tensor, fmt, mantissa_bits: int, min_normal_exp: int) -> torch.Tensor:
    """Half an ulp at each value's binade (or half the subnormal step) in its block's scaled format,
    plus the clamp of values between the format's max and 2^(emax+1), which the OCP v1.0 scale allows."""
    blocks = x_XL.view(*x_XL.shape[:-1], -1, 32)
    scale = torch.exp2(torch.floor(torch.log2(blocks.abs().amax(-1, keepdim=True))) - fmt.emax)
    scaled = blocks.abs() / scale
    binade = torch.floor(torch.log2(scaled.clamp_min(2.0**min_normal_exp)))
    half_ulp = torch.exp2(binade - mantissa_bits - 1)
    clamp = (scaled - fmt.max).clamp_min(0)
    return ((half_ulp + clamp) * scale).view_as(x_XL)


@pytest.mark.parametrize("fmt, mantissa_bits, min_normal_exp", [(E4M3, 3, -6), (E5M2, 2, -14)])
def test_mx_rounding_stays_within_half_an_ulp(fmt, mantissa_bits, min_normal_exp):
    torch.manual_seed(0)
    x = torch.randn(16, 256) * torch.logspace(-3, 3, 256)
    error = (fake_quantize_mx(x, fmt, dim=-1) - x).abs()
    bound = _mx_error_bound(x, fmt, mantissa_bits, min_normal_exp)
    assert (error <= bound * (1 + 1e-6)).all()
    assert (error > 0).any(), "values are actually rounded"


def test_mx_scales_are_powers_of_two_chosen_from_the_block_amax():
    assert mx_scale_exponents(torch.tensor([448.0]), E4M3).item() == 0  # floor(log2 448) = 8 = emax
    assert mx_scale_exponents(torch.tensor([1.0]), E4M3).item() == -8
    assert mx_scale_exponents(torch.tensor([0.0]), E4M3).item() == -127  # all-zero block: smallest scale
    assert mx_scale_exponents(torch.tensor([2.0**-130]), E4M3).item() == -127  # clamped to E8M0's range
    assert mx_scale_exponents(torch.tensor([2.0**100 * 1.5]), E4M3).item() == 92
    assert mx_scale_exponents(torch.tensor([float("inf")]), E4M3).isnan().item()


def test_mx_keeps_the_format_max_exact_and_zero_blocks_zero():
    block = torch.zeros(2, 32)
    block[0, 0] = 448.0
    block[0, 1] = -448.0
    out = fake_quantize_mx(block, E4M3, dim=-1)
    assert out[0, 0] == 448.0 and out[0, 1] == -448.0
    assert torch.equal(out[1], torch.zeros(32))


def test_mx_subnormals_round_to_the_format_grid():
    block = torch.full((1, 32), 2.0**-140)  # an fp32 subnormal: amax clamps the scale at 2^-127
    block[0, 1] = 2.0**-133
    out = fake_quantize_mx(block, E4M3, dim=-1)
    # at scale 2^-127 the smallest E4M3 subnormal is 2^-9 * 2^-127 = 2^-136: 2^-140 flushes to zero
    assert out[0, 0] == 0.0
    assert out[0, 1] == 2.0**-133


def test_non_finite_values_poison_their_block_only():
    x = torch.randn(3, 64)
    x[0, 5] = float("nan")
    x[1, 40] = float("inf")
    out = fake_quantize_mx(x, E4M3, dim=-1)
    assert out[0, :32].isnan().all() and out[0, 32:].isfinite().all()
    assert out[1, 32:].isnan().all() and out[1, :32].isfinite().all()
    assert out[2].isfinite().all()


def test_rowwise_fp8_uses_one_scale_per_row_and_saturates_nothing():
    x = torch.randn(8, 100) * 1000
    out = fake_quantize_rowwise(x, E4M3, dim=-1)
    assert ((out - x).abs() <= x.abs().amax(-1, keepdim=True) / 448 * 16).all()
    assert torch.allclose(out.abs().amax(-1), x.abs().amax(-1), rtol=1e-6), "the row max maps onto the format max"


def _grouped(x, w, offsets):
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)


@pytest.mark.parametrize("kind, tolerance", [("mxfp8", 0.08), ("fp8", 0.08)])
def test_emulated_low_precision_grouped_mm_tracks_fp32(kind, tolerance):
    torch.manual_seed(0)
    policy = resolve_precision(PrecisionConfig(experts=kind), load_profile("cpu"))
    x = torch.randn(96, 64, requires_grad=True)
    w = torch.randn(4, 48, 64, requires_grad=True)
    offsets = torch.tensor([20, 20, 70, 96], dtype=torch.int32)
    y = EmulatedLowPrecisionGroupedMM.apply(x, w, offsets, policy.recipe, _grouped)
    grad = torch.randn_like(y)
    y.backward(grad)
    x_ref, w_ref = x.detach().requires_grad_(), w.detach().requires_grad_()
    y_ref = _grouped(x_ref, w_ref, offsets)
    y_ref.backward(grad)
    for ours, ref in [(y, y_ref), (x.grad, x_ref.grad), (w.grad, w_ref.grad)]:
        relative = ((ours - ref).norm() / ref.norm()).item()
        assert 1e-4 < relative < tolerance, relative  # rounded, but close
    assert torch.equal(w.grad[1], torch.zeros(48, 64)), "an expert with no tokens gets no gradient"


def test_profiles_drive_defaults_and_the_config_overrides_them():
    policy = resolve_precision(PrecisionConfig(), load_profile("h100"))
    assert (policy.param_dtype, policy.compute_dtype) == ("fp32", "bf16")
    overridden = resolve_precision(
        PrecisionConfig(compute_dtype="fp16", loss_scaling={"kind": "dynamic"}), load_profile("h100")
    )
    assert overridden.compute_dtype == "fp16" and overridden.loss_scaling == "dynamic"
    assert "compute_dtype=fp16 (config)" in overridden.decisions


def test_fp8_formats_follow_the_vendor():
    assert (
        resolve_precision(PrecisionConfig(experts="fp8"), load_profile("mi300x")).recipe.forward_format.dtype
        == torch.float8_e4m3fnuz
    )
    assert (
        resolve_precision(PrecisionConfig(experts="fp8"), load_profile("h100")).recipe.forward_format.dtype
        == torch.float8_e4m3fn
    )


def test_the_gradient_format_follows_the_kind_unless_the_config_names_one():
    def grad_format(kind: str, profile: str, gradient_format: str = "auto") -> torch.dtype:
        config = PrecisionConfig(experts=kind, gradient_format=gradient_format)
        return resolve_precision(config, load_profile(profile)).recipe.grad_format.dtype

    assert grad_format("mxfp8", "b200") == torch.float8_e5m2
    assert grad_format("mxfp8", "b200", "e4m3") == torch.float8_e4m3fn  # what torchao's MXFP8 kernel computes
    assert grad_format("fp8", "h100") == torch.float8_e4m3fn
    assert grad_format("fp8", "mi300x", "e5m2") == torch.float8_e5m2fnuz  # the vendor's variant


def test_mxfp8_with_e4m3_gradients_trains_in_the_emulation(make_config, tmp_path):
    from ferry.train import train

    result = train(make_config("train.steps=3", "precision.experts=mxfp8", "precision.gradient_format=e4m3"))
    assert len(result.losses) == 3 and all(loss == loss for loss in result.losses)


def test_unsupported_formats_emulate_or_fail_as_configured():
    emulated = resolve_precision(PrecisionConfig(experts="mxfp8"), load_profile("h100"))
    assert emulated.experts_mode == "emulated" and "emulated" in " ".join(emulated.decisions)
    assert resolve_precision(PrecisionConfig(experts="mxfp8"), load_profile("b200")).experts_mode == "native"
    with pytest.raises(
        UserError, match="precision.experts: mxfp8 is not supported natively by hardware profile 'mi300x'"
    ):
        resolve_precision(PrecisionConfig(experts="mxfp8", on_unsupported="error"), load_profile("mi300x"))


def test_every_profile_cites_sources_and_has_the_required_peaks():
    assert {"cpu", "h100", "h200", "b200", "b300", "mi300x", "mi325x", "mi355x"} <= set(profile_names())
    for name in profile_names():
        profile = load_profile(name)
        assert profile.sources and profile.peak_flops("fp32") > 0 and profile.peak_flops("bf16") > 0
        if profile.native_mx:
            assert profile.peak_flops("mxfp8") > 0


def test_dynamic_scaler_skips_overflow_backs_off_and_grows_again():
    scaler = LossScaler("dynamic", LossScalingConfig(init_scale=1024.0, growth_interval=2))
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.tensor([1024.0, float("inf"), 0.0])
    assert not scaler.unscale_and_check([param])
    scaler.update(False)
    assert scaler.scale == 512.0 and scaler.skipped_steps == 1
    for _ in range(2):
        param.grad = torch.full((3,), 512.0)
        assert scaler.unscale_and_check([param])
        assert torch.equal(param.grad, torch.ones(3))
        scaler.update(True)
    assert scaler.scale == 1024.0
    restored = LossScaler("dynamic", LossScalingConfig())
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()
