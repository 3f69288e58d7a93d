"""`moe.fp8_grouped_mm` and `moe.mxfp8_grouped_mm` on torchao's MoE training kernels: quantization fused on the GPU.

ferry's own native FP8 path (torch_scaled_grouped_mm.py) quantizes every operand in
several plain tensor ops (amax, divide, round, cast, a copy for the column-major
operand) before torch's scaled grouped GEMM. torchao 0.17+ (`torchao.prototype.
moe_training`) does each quantization in one fused Triton or CUDA kernel that writes the
layout the GEMM reads, then calls the same `torch._scaled_grouped_mm`, forward and both
gradients, in one autograd function per GEMM. What its kernels compute, against ferry's
recipes:

- FP8 row-wise (`_to_fp8_rowwise_then_scaled_grouped_mm`): OCP E4M3 for every operand,
  gradients included, one scale per row (per channel and expert group for the weight
  gradient), as ferry's FP8 recipe on NVIDIA; but every scale is rounded down to a power
  of two, so elements round differently from the emulation's: on random data (a CPU model of
  that scaling) both lie about 3.6% (relative norm) from the exact product and 5% from each other. torch's
  row-wise kernel runs on compute capability 9.0 only (torchao's README says SM89+, but
  `torch._scaled_grouped_mm` refuses 8.9).
- MXFP8 (`_to_mxfp8_then_scaled_grouped_mm`): blocks of 32, E8M0 scales by the OCP rule
  (torchao's FLOOR mode, the one the emulation uses), but E4M3 for every operand: it
  cannot compute a recipe with E5M2 gradients (ferry's default MXFP8 recipe) and refuses
  one; `precision.gradient_format: e4m3` gives the recipe it computes.
  Compute capability 10.x, and a torchao built with its CUDA 12.8+ kernels.

Both take the tokens row-major, the weights as (E, I, O) column-major (`w_EOI.transpose`,
no copy), int32 group ends, widths that are multiples of 16 (FP8) or 32 (MXFP8), and
token groups of multiples of 16 or 32 rows (the weight gradient reduces along tokens).
So each group is moved to an aligned start with zero rows between, which change no sum
and no amax, and the real rows are taken back afterwards; the padded row count is a
bound fixed by the shapes, so no group size is read on the host. The padded copy of
each GEMM's input is what torchao keeps for the backward: about one extra activation
per expert GEMM. torchao is imported where a probe or a call needs it, so ferry
imports without it (`pip install ferry-moe[gpu]`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import partial

import torch

from ferry.config import UserError
from ferry.kernels.amp import outside_autocast
from ferry.kernels.registry import RecipeRefused

MOE_TRAINING = "torchao.prototype.moe_training"
FP8_KERNEL = "_to_fp8_rowwise_then_scaled_grouped_mm"
MXFP8_KERNEL = "_to_mxfp8_then_scaled_grouped_mm"
MINIMUM_VERSION = "0.17"  # the first release with both kernels under these names (0.12-0.16 had others)
NOT_INSTALLED = "torchao is not installed (pip install ferry-moe[gpu])"
ELEMENTS = torch.float8_e4m3fn
FP8_ALIGN = 16
MX_ALIGN = 32

GroupedKernel = Callable[..., torch.Tensor]


def probe_fp8(device: torch.device, dtype: torch.dtype) -> str | None:
    reason = _probe_device(device, dtype)
    if reason is None and torch.cuda.get_device_capability(device) != (9, 0):
        reason = f"torch's row-wise FP8 grouped GEMM (torchao calls it) runs on compute capability 9.0, {_has(device)}"
    return reason or _probe_kernel(FP8_KERNEL)


def probe_mxfp8(device: torch.device, dtype: torch.dtype) -> str | None:
    reason = _probe_device(device, dtype)
    if reason is None and torch.cuda.get_device_capability(device)[0] != 10:
        reason = f"torchao's MXFP8 grouped GEMM runs on compute capability 10.x (SM100), {_has(device)}"
    reason = reason or _probe_kernel(MXFP8_KERNEL)
    if reason is None and not _mxfp8_kernels_built():
        version = importlib.import_module("torchao").__version__
        reason = f"torchao {version} was built without its SM100 MXFP8 kernels (they need a CUDA 12.8+ build)"
    return reason


@outside_autocast
def fp8_grouped_mm(x_NI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor, recipe) -> torch.Tensor:
    _refuse(fp8_recipe_refusal(recipe))
    _check_widths("moe.fp8_grouped_mm", w_EOI, FP8_ALIGN)
    kernel = partial(
        _kernel(FP8_KERNEL), out_dtype=x_NI.dtype, float8_dtype=ELEMENTS, pad_token_groups_for_grouped_mm=False
    )
    return grouped_mm_with(kernel, FP8_ALIGN, x_NI, w_EOI, offsets_E)


@outside_autocast
def mxfp8_grouped_mm(x_NI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor, recipe) -> torch.Tensor:
    _refuse(mxfp8_recipe_refusal(recipe))
    _check_widths("moe.mxfp8_grouped_mm", w_EOI, MX_ALIGN)
    scale_modes = importlib.import_module("torchao.prototype.mx_formats.config").ScaleCalculationMode
    kernel = partial(
        _kernel(MXFP8_KERNEL),
        out_dtype=x_NI.dtype,
        scale_calculation_mode=scale_modes.FLOOR,
        pad_token_groups_for_grouped_mm=False,
    )
    return grouped_mm_with(kernel, MX_ALIGN, x_NI, w_EOI, offsets_E)


def fp8_recipe_refusal(recipe) -> str | None:
    """Why torchao's FP8 kernel cannot compute `recipe`, or None when it can."""
    return _refusal(recipe, "fp8", "row-wise scaled FP8")


def mxfp8_recipe_refusal(recipe) -> str | None:
    """Why torchao's MXFP8 kernel cannot compute `recipe`, or None when it can."""
    return _refusal(recipe, "mxfp8", "MXFP8")


def grouped_mm_with(
    kernel: GroupedKernel, align: int, x_NI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor
) -> torch.Tensor:
    """The op over any kernel with torchao's contract (tests pass a reference): `kernel(a_PI, b_EIO, offs=...)`
    with `a` row-major, `b` column-major per expert, and int32 group ends on multiples of `align` rows."""
    x_PI, padded_offsets_E, rows_N = _aligned_groups(x_NI, offsets_E, align)
    w_EOI = _ZeroGradientOfEmptyExperts.apply(w_EOI.contiguous(), offsets_E)
    y_PO = kernel(x_PI, w_EOI.transpose(-2, -1), offs=padded_offsets_E)
    return y_PO.index_select(0, rows_N)


def _aligned_groups(x_NI: torch.Tensor, offsets_E: torch.Tensor, align: int):
    """x with each group's rows moved to a start that is a multiple of `align`, zero rows between and after;
    the new group ends (int32) and where each row went. Row count: a bound from the shapes, as torchao's own."""
    num_rows, num_groups = x_NI.shape[0], offsets_E.shape[0]
    ends_E = offsets_E.long()
    sizes_E = torch.diff(ends_E, prepend=ends_E.new_zeros(1))
    padded_sizes_E = (sizes_E + align - 1) // align * align
    padded_ends_E = torch.cumsum(padded_sizes_E, 0)
    rows_N = torch.arange(num_rows, device=x_NI.device)
    group_N = torch.searchsorted(ends_E, rows_N, right=True)
    shift_E = (padded_ends_E - padded_sizes_E) - (ends_E - sizes_E)
    destination_N = rows_N + shift_E[group_N]
    bound = (num_rows + num_groups * align + align - 1) // align * align
    x_PI = x_NI.new_zeros(bound, x_NI.shape[1]).index_copy(0, destination_N, x_NI)
    return x_PI, padded_ends_E.to(torch.int32), destination_N


class _ZeroGradientOfEmptyExperts(torch.autograd.Function):
    """The identity; its backward zeroes the gradient of experts without rows, which the kernel does not write."""

    @staticmethod
    def forward(ctx, w_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(offsets_E)
        return w_EOI.view_as(w_EOI)

    @staticmethod
    def backward(ctx, grad_EOI: torch.Tensor):
        (offsets_E,) = ctx.saved_tensors
        empty_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1)) == 0
        return grad_EOI.masked_fill(empty_E.view(-1, 1, 1), 0.0), None


def _probe_device(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cuda" or torch.version.hip:
        here = "a ROCm GPU" if device.type == "cuda" else device.type
        return f"torchao's MoE training kernels run on NVIDIA CUDA GPUs, this device is {here}"
    if dtype != torch.bfloat16:
        return f"its kernels write bfloat16, the run computes in {dtype}"
    return None


def _has(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"this GPU has {major}.{minor}"


def _probe_kernel(name: str) -> str | None:
    try:
        _kernel(name)
    except UserError as exc:
        return str(exc)
    return None


def _kernel(name: str) -> GroupedKernel:
    """torchao's differentiable kernel `name`; a `UserError` saying what to install when it is missing."""
    try:
        torchao = importlib.import_module("torchao")
    except ModuleNotFoundError as exc:
        if exc.name == "torchao":
            raise UserError(NOT_INSTALLED) from exc
        raise UserError(f"torchao cannot be imported: {exc}") from exc
    try:
        return getattr(importlib.import_module(MOE_TRAINING), name)
    except (ImportError, AttributeError) as exc:
        raise UserError(
            f"torchao {torchao.__version__} has no {MOE_TRAINING}.{name} (ferry needs torchao {MINIMUM_VERSION} "
            f"or newer): {exc}"
        ) from exc


def _mxfp8_kernels_built() -> bool:
    """Whether torchao's build holds the SM100 kernels its MXFP8 path needs, where its module says so (a private
    flag of torchao's; without it, the kernel's own assertion at the first call says the same)."""
    try:
        module = importlib.import_module(f"{MOE_TRAINING}.mxfp8_grouped_mm")
    except ImportError:
        return True
    return bool(getattr(module, "_SM100_KERNELS_AVAILABLE", True))


def _check_widths(op: str, w_EOI: torch.Tensor, align: int) -> None:
    in_width, out_width = w_EOI.shape[2], w_EOI.shape[1]
    if in_width % align or out_width % align:
        raise UserError(
            f"{op} torchao needs widths that are multiples of {align}, got in {in_width} and out {out_width} "
            f"(model.dim, model.moe.expert_ffn_dim): make them multiples of {align}, or pin "
            f'kernels.ops."{op}" to portable'
        )


def _refusal(recipe, kind: str, what: str) -> str | None:
    formats = (recipe.forward_format.dtype, recipe.grad_format.dtype)
    if recipe.kind == kind and formats == (ELEMENTS, ELEMENTS):
        return None
    return (
        f"moe.{kind}_grouped_mm torchao computes {what} with {ELEMENTS} for every operand, gradients included; "
        f"the recipe is {recipe.kind} with {formats[0]} forward and {formats[1]} gradients"
    )


def _refuse(reason: str | None) -> None:
    if reason is not None:
        raise RecipeRefused(reason)
