"""Low-precision number formats: FP8 (OCP and FNUZ variants) and OCP Microscaling MXFP8.

Quantization here is *fake* quantization: values are rounded exactly as the format
would store them and returned in the working dtype, so any device can reproduce the
numerics of hardware that computes in the format natively. The scales follow the
formats' rules (power-of-two E8M0 block scales for MX, an fp32 amax scale for FP8),
so an emulated run and a native one see the same rounded operands.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MX_BLOCK = 32
E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127


@dataclass(frozen=True)
class FloatFormat:
    """An element format: its torch dtype, largest finite value and largest exponent (emax)."""

    dtype: torch.dtype

    @property
    def max(self) -> float:
        return torch.finfo(self.dtype).max

    @property
    def emax(self) -> int:
        """floor(log2(max)): the exponent of the largest normal value (8 for E4M3, 15 for E5M2)."""
        return int(torch.tensor(self.max).log2().floor())


def float_format(name: str) -> FloatFormat:
    return FloatFormat(getattr(torch, name))


def round_to_format(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Round to the nearest value of `fmt`, saturating at ±max; NaN and ±inf become NaN."""
    finite = torch.isfinite(x)
    clamped = x.clamp(-fmt.max, fmt.max)
    rounded = clamped.to(fmt.dtype).to(x.dtype)
    return torch.where(finite, rounded, torch.full_like(x, float("nan")))


def mx_scale_exponents(amax: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """The OCP MX shared exponent per block: floor(log2(amax)) - emax(element), clamped to E8M0.

    An all-zero block gets the smallest scale (2^-127) and stays zero; a block holding
    inf or NaN gets NaN (E8M0's 0xFF), so overflow propagates to the loss scaler.
    """
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    exponent = torch.floor(torch.log2(safe)) - fmt.emax
    exponent = torch.where(amax > 0, exponent, torch.full_like(amax, E8M0_MIN_EXP))
    exponent = exponent.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    return torch.where(torch.isfinite(amax), exponent, torch.full_like(amax, float("nan")))


def quantize_mx(x: torch.Tensor, fmt: FloatFormat, dim: int, block_ids: torch.Tensor | None = None):
    """MX-quantize along `dim` in blocks of 32: (elements in `fmt`'s dtype, fp32 power-of-two scales).

    The scales have `x`'s shape with `dim` moved last and holding one entry per block.
    `block_ids` (one id per position along `dim`, non-decreasing) overrides the plain
    blocks of 32, so that a block never spans two experts' token groups.
    """
    moved = x.movedim(dim, -1).float()
    if block_ids is None:
        block_ids = torch.arange(moved.shape[-1], device=x.device) // MX_BLOCK
    scale_XB = torch.exp2(mx_scale_exponents(_block_amax(moved, block_ids), fmt))
    return _scaled_elements(moved, scale_XB, block_ids, fmt, dim), scale_XB


def quantize_rowwise(x: torch.Tensor, fmt: FloatFormat, dim: int, block_ids: torch.Tensor | None = None):
    """FP8 with one fp32 scale (amax / max) per row along `dim`, or per group of `block_ids` along it.

    Returns the elements in `fmt`'s dtype and the scales, laid out as `quantize_mx`'s.
    """
    moved = x.movedim(dim, -1).float()
    if block_ids is None:
        block_ids = torch.zeros(moved.shape[-1], dtype=torch.long, device=x.device)
    amax_XB = _block_amax(moved, block_ids)
    scale_XB = torch.where(amax_XB > 0, amax_XB / fmt.max, torch.ones_like(amax_XB))
    return _scaled_elements(moved, scale_XB, block_ids, fmt, dim), scale_XB


def dequantize(q: torch.Tensor, scale_XB: torch.Tensor, dim: int, block_ids: torch.Tensor | None, dtype: torch.dtype):
    """Elements times their block's scale, in `dtype`: exactly what a scaled GEMM multiplies."""
    moved = q.movedim(dim, -1).float()
    if block_ids is None:
        block_ids = _plain_block_ids(moved.shape[-1], scale_XB.shape[-1], q.device)
    return (moved * _per_position(scale_XB, block_ids)).to(dtype).movedim(-1, dim)


def fake_quantize_mx(x: torch.Tensor, fmt: FloatFormat, dim: int, block_ids: torch.Tensor | None = None):
    """MX-quantize along `dim` and dequantize: `x` rounded as MXFP8 hardware would see it."""
    q, scale_XB = quantize_mx(x, fmt, dim, block_ids)
    return dequantize(q, scale_XB, dim, block_ids, x.dtype)


def fake_quantize_rowwise(x: torch.Tensor, fmt: FloatFormat, dim: int, block_ids: torch.Tensor | None = None):
    """Row-wise FP8-quantize along `dim` and dequantize."""
    q, scale_XB = quantize_rowwise(x, fmt, dim, block_ids)
    return dequantize(q, scale_XB, dim, block_ids, x.dtype)


def _scaled_elements(moved_XL, scale_XB, block_ids_L, fmt: FloatFormat, dim: int) -> torch.Tensor:
    """The elements `x / scale` rounded to `fmt` (NaN for non-finite input), back in `x`'s layout."""
    rounded = round_to_format(moved_XL / _per_position(scale_XB, block_ids_L), fmt)
    return rounded.to(fmt.dtype).movedim(-1, dim)


def _plain_block_ids(length: int, num_blocks: int, device: torch.device) -> torch.Tensor:
    """Blocks of 32 when there are several per row, else one block for the whole row (row-wise FP8)."""
    if num_blocks == 1:
        return torch.zeros(length, dtype=torch.long, device=device)
    return torch.arange(length, device=device) // MX_BLOCK


def _block_amax(x_XL: torch.Tensor, block_ids_L: torch.Tensor) -> torch.Tensor:
    """Largest magnitude per block along the last dim; a NaN makes its block's amax inf."""
    num_blocks = int(block_ids_L[-1]) + 1 if block_ids_L.numel() else 0
    magnitude = torch.where(x_XL.isnan(), torch.full_like(x_XL, float("inf")), x_XL.abs())
    amax_XB = x_XL.new_zeros(*x_XL.shape[:-1], num_blocks)
    return amax_XB.scatter_reduce(-1, block_ids_L.expand_as(x_XL), magnitude, reduce="amax", include_self=True)


def _per_position(values_XB: torch.Tensor, block_ids_L: torch.Tensor) -> torch.Tensor:
    return values_XB.index_select(-1, block_ids_L)
