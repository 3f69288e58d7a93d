"""Low-precision expert GEMM recipes: which format each operand of each expert GEMM is rounded to.

A recipe says how each of the three GEMMs of an expert layer rounds its operands:
forward (x, w: along the reduction dim I), input gradient (dy, w: along O) and
weight gradient (dy, x: along tokens, blocks never crossing an expert's group).
FP8 rounds every operand to the profile's E4M3 variant with row-wise scales; MXFP8
uses OCP E4M3 elements forward and E5M2 for gradients.
The kernel ops `moe.fp8_grouped_mm` and `moe.mxfp8_grouped_mm` take a recipe with
every call: their portable implementation emulates it, a vendor one computes natively.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ferry.precision.formats import (
    MX_BLOCK,
    FloatFormat,
    fake_quantize_mx,
    fake_quantize_rowwise,
    quantize_mx,
    quantize_rowwise,
)


@dataclass(frozen=True)
class LowPrecisionRecipe:
    kind: Literal["fp8", "mxfp8"]
    forward_format: FloatFormat
    grad_format: FloatFormat

    def quantize(self, x: torch.Tensor, fmt: FloatFormat, dim: int, block_ids: torch.Tensor | None = None):
        """`x` rounded to `fmt` along `dim` and dequantized (what emulation multiplies)."""
        if self.kind == "mxfp8":
            return fake_quantize_mx(x, fmt, dim, block_ids)
        return fake_quantize_rowwise(x, fmt, dim, block_ids)

    def quantize_scaled(
        self,
        x: torch.Tensor,
        fmt: FloatFormat,
        dim: int,
        block_ids: torch.Tensor | None = None,
        num_blocks: int | None = None,
    ):
        """The elements in `fmt`'s dtype and their scales (what a native scaled GEMM multiplies); `num_blocks`,
        when the caller knows how many blocks `block_ids` names, keeps the count off the host."""
        if self.kind == "mxfp8":
            return quantize_mx(x, fmt, dim, block_ids, num_blocks)
        return quantize_rowwise(x, fmt, dim, block_ids, num_blocks)

    def token_block_ids(self, offsets_E: torch.Tensor, num_rows: int) -> torch.Tensor:
        """Block id of every token row: MX blocks of 32 restart at each expert's group; FP8 uses one per group."""
        rows = torch.arange(num_rows, device=offsets_E.device)
        offsets = offsets_E.long()
        group_N = torch.searchsorted(offsets, rows, right=True)
        if self.kind == "fp8":
            return group_N
        starts_E = torch.cat([offsets.new_zeros(1), offsets[:-1]])
        blocks_E = (offsets - starts_E + MX_BLOCK - 1) // MX_BLOCK
        block_base_E = torch.cumsum(blocks_E, 0) - blocks_E
        return block_base_E[group_N] + (rows - starts_E[group_N]) // MX_BLOCK
