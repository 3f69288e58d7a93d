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
    rounded = x.clamp(-fmt.max, fmt.max).to(fmt.dtype).to(x.dtype)
    return torch.where(torch.isfinite(x), rounded, float("nan"))


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


def quantize_mx(
    x: torch.Tensor, fmt: FloatFormat, dim: int, block_ids: torch.Tensor | None = None, num_blocks: int | None = None
):
    """MX-quantize along `dim` in blocks of 32: (elements in `fmt`'s dtype, fp32 power-of-two scales).

    The scales have `x`'s shape with `dim` moved last and holding one entry per block.
    `block_ids` (one id per position along `dim`, non-decreasing) overrides the plain
    blocks of 32, so that a block never spans two experts' token groups.
    """
    moved = x.movedim(dim, -1).float()
    blocks = _Blocks.of(moved.shape[-1], MX_BLOCK, block_ids, num_blocks)
    scale_XB = torch.exp2(mx_scale_exponents(blocks.amax(moved), fmt))
    return _scaled_elements(moved, scale_XB, blocks, fmt, dim), scale_XB


def quantize_rowwise(
    x: torch.Tensor, fmt: FloatFormat, dim: int, block_ids: torch.Tensor | None = None, num_blocks: int | None = None
):
    """FP8 with one fp32 scale (amax / max) per row along `dim`, or per group of `block_ids` along it.

    Returns the elements in `fmt`'s dtype and the scales, laid out as `quantize_mx`'s. With `block_ids`,
    `num_blocks` (when the caller knows it: the number of experts) spares reading the last id on the host.
    """
    moved = x.movedim(dim, -1).float()
    blocks = _Blocks.of(moved.shape[-1], moved.shape[-1], block_ids, num_blocks)
    amax_XB = blocks.amax(moved)
    scale_XB = torch.where(amax_XB > 0, amax_XB / fmt.max, torch.ones_like(amax_XB))
    return _scaled_elements(moved, scale_XB, blocks, fmt, dim), scale_XB


def dequantize(q: torch.Tensor, scale_XB: torch.Tensor, dim: int, block_ids: torch.Tensor | None, dtype: torch.dtype):
    """Elements times their block's scale, in `dtype`: exactly what a scaled GEMM multiplies."""
    moved = q.movedim(dim, -1).float()
    length, num_blocks = moved.shape[-1], scale_XB.shape[-1]
    blocks = _Blocks.of(length, length if num_blocks == 1 else MX_BLOCK, block_ids)
    return blocks.multiply(moved, scale_XB).to(dtype).movedim(-1, dim)


def fake_quantize_mx(x: torch.Tensor, fmt: FloatFormat, dim: int, block_ids: torch.Tensor | None = None):
    """MX-quantize along `dim` and dequantize: `x` rounded as MXFP8 hardware would see it."""
    q, scale_XB = quantize_mx(x, fmt, dim, block_ids)
    return dequantize(q, scale_XB, dim, block_ids, x.dtype)


def fake_quantize_rowwise(x: torch.Tensor, fmt: FloatFormat, dim: int, block_ids: torch.Tensor | None = None):
    """Row-wise FP8-quantize along `dim` and dequantize."""
    q, scale_XB = quantize_rowwise(x, fmt, dim, block_ids)
    return dequantize(q, scale_XB, dim, block_ids, x.dtype)


def _scaled_elements(moved_XL, scale_XB, blocks: _Blocks, fmt: FloatFormat, dim: int) -> torch.Tensor:
    """The elements `x / scale` rounded to `fmt` (NaN for non-finite input), back in `x`'s layout."""
    rounded = round_to_format(blocks.divide(moved_XL, scale_XB), fmt)
    return rounded.to(fmt.dtype).movedim(-1, dim)


@dataclass(frozen=True)
class _Blocks:
    """How the last dim splits into scaling blocks: equal runs of `size` (fast), or one id per position.

    Equal runs are handled as a reshaped view, so a block's amax and its scale
    reach every element without materialising a per-element index.
    """

    size: int | None
    ids_L: torch.Tensor | None
    count: int | None = None  # blocks of `ids_L`, when known without reading the ids

    @staticmethod
    def of(length: int, size: int, block_ids_L: torch.Tensor | None, count: int | None = None) -> _Blocks:
        if block_ids_L is not None:
            return _Blocks(None, block_ids_L, count)
        if length and length % size == 0:
            return _Blocks(size, None)
        return _Blocks(None, torch.arange(length) // size)

    def amax(self, x_XL: torch.Tensor) -> torch.Tensor:
        """Largest magnitude per block; a NaN makes its block's amax inf."""
        if self.size is not None:
            amax_XB = x_XL.abs().unflatten(-1, (-1, self.size)).amax(-1)
            return torch.nan_to_num(amax_XB, nan=float("inf"), posinf=float("inf"))
        ids_L = self.ids_L.to(x_XL.device)
        num_blocks = self.count if self.count is not None else (int(ids_L[-1]) + 1 if ids_L.numel() else 0)
        magnitude = torch.nan_to_num(x_XL.abs(), nan=float("inf"), posinf=float("inf"))
        amax_XB = x_XL.new_zeros(*x_XL.shape[:-1], num_blocks)
        return amax_XB.scatter_reduce(-1, ids_L.expand_as(x_XL), magnitude, reduce="amax", include_self=True)

    def divide(self, x_XL: torch.Tensor, scale_XB: torch.Tensor) -> torch.Tensor:
        if self.size is not None:
            return (x_XL.unflatten(-1, (-1, self.size)) / scale_XB.unsqueeze(-1)).flatten(-2)
        return x_XL / scale_XB.index_select(-1, self.ids_L.to(x_XL.device))

    def multiply(self, x_XL: torch.Tensor, scale_XB: torch.Tensor) -> torch.Tensor:
        if self.size is not None:
            return (x_XL.unflatten(-1, (-1, self.size)) * scale_XB.unsqueeze(-1)).flatten(-2)
        return x_XL * scale_XB.index_select(-1, self.ids_L.to(x_XL.device))
