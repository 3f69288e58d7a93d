"""The low-precision expert GEMM ops: the native FP8 path computes what the emulation computes.

`torch._scaled_grouped_mm` runs on CUDA SM90 only, so on a CPU the vendor
implementation runs over a reference kernel with the same contract, computed group by
group as a row-wise scaled product (the way torch's own tests check the grouped kernel).
The reference also enforces the contract's layouts, dtypes and the 16-row alignment
of reduction-dim groups, so a layout or padding mistake fails here, not on the GPU.
Tolerance 1e-5 relative in fp32: both sides multiply the same FP8 elements and
scales; they differ in where the scales are applied (before or after the sums).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from ferry.kernels import portable_kernels
from ferry.kernels.vendor.torch_scaled_grouped_mm import (
    CUDA_ELEMENTS,
    GROUP_ALIGN_ROWS,
    ROCM_ELEMENTS,
    scaled_grouped_mm_with,
)
from ferry.platform.hardware import load_profile
from ferry.precision import PrecisionConfig
from ferry.precision.formats import float_format
from ferry.precision.kernels import low_precision_op, with_low_precision_experts
from ferry.precision.policy import resolve_precision
from ferry.precision.recipe import LowPrecisionRecipe

TOLERANCE = 1e-5
FP8 = LowPrecisionRecipe("fp8", float_format("float8_e4m3fn"), float_format("float8_e4m3fn"))  # NVIDIA SM90
FP8_FNUZ = LowPrecisionRecipe("fp8", float_format("float8_e4m3fnuz"), float_format("float8_e4m3fnuz"))  # AMD MI300


def reference_scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype):
    """torch._scaled_grouped_mm's contract, checked, computed group by group."""
    assert a.dtype == b.dtype and a.dtype in (CUDA_ELEMENTS, ROCM_ELEMENTS), "both operands E4M3, one variant"
    assert scale_a.dtype == scale_b.dtype == torch.float32 and offs.dtype == torch.int32
    assert a.stride(-1) == 1, "the left operand must be row-major"
    assert b.stride(-2) == 1, "the right operand must be column-major"
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if b.ndim == 3:  # 2d x 3d: groups of rows of `a`, one matrix of `b` each
        assert scale_a.shape == (a.shape[0],) and scale_b.shape == (b.shape[0], b.shape[2])
        out = torch.zeros(a.shape[0], b.shape[2], dtype=out_dtype)
        for group, (start, end) in enumerate(zip(starts, ends)):
            if end > start:
                out[start:end] = _row_col_scaled_mm(
                    a[start:end], b[group], scale_a[start:end], scale_b[group], out_dtype
                )
        return out
    rows, cols, groups = a.shape[0], b.shape[1], len(ends)  # 2d x 2d: groups along the reduction dim
    assert scale_a.shape == (groups * rows,) and scale_b.shape == (groups * cols,)
    out = torch.zeros(groups, rows, cols, dtype=out_dtype)
    for group, (start, end) in enumerate(zip(starts, ends)):
        assert (end - start) % GROUP_ALIGN_ROWS == 0, "reduction-dim groups must be multiples of 16 rows"
        if end > start:
            out[group] = _row_col_scaled_mm(
                a[:, start:end],
                b[start:end],
                scale_a[group * rows : (group + 1) * rows],
                scale_b[group * cols : (group + 1) * cols],
                out_dtype,
            )
    return out


def _row_col_scaled_mm(a, b, scale_rows, scale_cols, out_dtype):
    """The row-wise scaled FP8 product: one scale per row of `a` and per column of `b`, after the sums.

    Every FP8 element is exact in float32, so the product is taken there and scaled afterwards, as the
    row-wise kernel applies its scales. torch's CPU `_scaled_mm` cannot serve on every supported torch:
    before 2.13 it takes per-tensor scales only and refuses the FNUZ variant.
    """
    product = a.to(torch.float32) @ b.to(torch.float32)
    return (product * scale_rows.view(-1, 1) * scale_cols.view(1, -1)).to(out_dtype)


def _fwd_bwd(fn, x, w, offsets):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w, offsets)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)))
    return [y.detach(), x.grad, w.grad]


@pytest.mark.parametrize("recipe, elements", [(FP8, CUDA_ELEMENTS), (FP8_FNUZ, ROCM_ELEMENTS)], ids=["ocp", "fnuz"])
@pytest.mark.parametrize(
    "group_sizes",
    [[16, 32, 0, 16], [5, 0, 37, 22, 0], [40, 9, 0, 0]],  # aligned; ragged with empty experts; empty at the end
    ids=["aligned", "ragged", "trailing-empty"],
)
def test_native_fp8_path_matches_the_emulation(group_sizes, recipe, elements):
    generator = torch.Generator().manual_seed(0)
    offsets = torch.tensor(group_sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    x = torch.randn(int(offsets[-1]), 64, generator=generator) * 3
    w = torch.randn(len(group_sizes), 48, 64, generator=generator) * 0.1
    portable = portable_kernels()["moe.fp8_grouped_mm"]
    expected = _fwd_bwd(lambda a, b, o: portable(a, b, o, recipe), x, w, offsets)
    actual = _fwd_bwd(
        partial(scaled_grouped_mm_with, reference_scaled_grouped_mm, elements, recipe=recipe), x, w, offsets
    )
    for got, want in zip(actual, expected, strict=True):
        assert ((got - want).norm() / want.norm()).item() < TOLERANCE
    for expert, size in enumerate(group_sizes):
        if size == 0:  # an expert without tokens gets a zero gradient, which the kernel need not write
            assert actual[2][expert].abs().sum() == 0


@pytest.mark.parametrize(
    "recipe",
    [
        LowPrecisionRecipe("mxfp8", float_format("float8_e4m3fn"), float_format("float8_e5m2")),
        LowPrecisionRecipe("fp8", float_format("float8_e4m3fn"), float_format("float8_e5m2")),  # E5M2 gradients
        FP8_FNUZ,  # the AMD variant, on a kernel that takes OCP elements
    ],
    ids=["mxfp8", "e5m2-gradients", "fnuz-on-cuda"],
)
def test_native_fp8_path_refuses_recipes_its_kernel_cannot_take(recipe):
    with pytest.raises(ValueError, match=f"with {CUDA_ELEMENTS} for every operand here; the recipe is {recipe.kind}"):
        scaled_grouped_mm_with(
            reference_scaled_grouped_mm,
            CUDA_ELEMENTS,
            torch.randn(4, 16),
            torch.randn(1, 16, 16),
            torch.tensor([4], dtype=torch.int32),
            recipe,
        )


@pytest.mark.parametrize("kind", ["fp8", "mxfp8"])
def test_low_precision_experts_bind_the_chosen_op(kind):
    recipe = resolve_precision(PrecisionConfig(experts=kind), load_profile("cpu")).recipe
    selection = with_low_precision_experts(portable_kernels(), recipe)
    assert f"inside {low_precision_op(recipe)} portable" in selection.choices["moe.grouped_mm"].reason
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(24, 64, generator=generator), torch.randn(3, 32, 64, generator=generator)
    offsets = torch.tensor([10, 10, 24], dtype=torch.int32)
    rounded = selection["moe.grouped_mm"](x, w, offsets)
    assert torch.equal(rounded, portable_kernels()[low_precision_op(recipe)](x, w, offsets, recipe))
    assert not torch.equal(rounded, portable_kernels()["moe.grouped_mm"](x, w, offsets))


def test_hardware_format_without_a_vendor_kernel_is_recorded_as_emulated():
    policy = resolve_precision(PrecisionConfig(experts="mxfp8"), load_profile("b200"))
    assert policy.experts_mode == "native" and policy.mfu_dtype == "mxfp8"
    policy.record_experts_kernel("portable", native=False)
    assert policy.experts_mode == "emulated" and policy.mfu_dtype != "mxfp8"
    assert policy.as_dict()["experts_kernel"] == "portable"
    assert "no vendor kernel" in policy.decisions[-1]


@pytest.mark.parametrize(
    "profile, elements", [("h100", CUDA_ELEMENTS), ("h200", CUDA_ELEMENTS), ("mi300x", ROCM_ELEMENTS)]
)
def test_the_profiles_fp8_recipe_is_one_the_native_kernel_takes(profile, elements):
    recipe = resolve_precision(PrecisionConfig(experts="fp8"), load_profile(profile)).recipe
    assert recipe.forward_format.dtype == recipe.grad_format.dtype == elements
