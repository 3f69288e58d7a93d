"""Low-precision expert GEMM recipes, and their emulation on any device.

A recipe says how each of the three GEMMs of an expert layer rounds its operands:
forward (x, w: along the reduction dim I), input gradient (dy, w: along O) and
weight gradient (dy, x: along tokens, blocks never crossing an expert's group).
Forward operands use the profile's E4M3 variant; gradients its E5M2 (or E4M3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ferry.precision.formats import MX_BLOCK, FloatFormat, fake_quantize_mx, fake_quantize_rowwise


@dataclass(frozen=True)
class LowPrecisionRecipe:
    kind: Literal["fp8", "mxfp8"]
    forward_format: FloatFormat
    grad_format: FloatFormat

    def quantize(self, x: torch.Tensor, fmt: FloatFormat, dim: int, block_ids: torch.Tensor | None = None):
        if self.kind == "mxfp8":
            return fake_quantize_mx(x, fmt, dim, block_ids)
        return fake_quantize_rowwise(x, fmt, dim, block_ids)

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


class EmulatedLowPrecisionGroupedMM(torch.autograd.Function):
    """y[group e] = x[group e] @ w[e].T with every operand rounded as `recipe` prescribes.

    `matmul(x_NI, w_EOI, offsets_E)` is the high-precision grouped GEMM underneath
    (the kernel registry's choice), so emulation changes numerics, not the kernel.
    """

    @staticmethod
    def forward(ctx, x_NI, w_EOI, offsets_E, recipe: LowPrecisionRecipe, matmul):
        ctx.save_for_backward(x_NI, w_EOI, offsets_E)
        ctx.recipe = recipe
        ctx.matmul = matmul
        fmt = recipe.forward_format
        return matmul(recipe.quantize(x_NI, fmt, -1), recipe.quantize(w_EOI, fmt, -1), offsets_E)

    @staticmethod
    def backward(ctx, dy_NO):
        x_NI, w_EOI, offsets_E = ctx.saved_tensors
        recipe: LowPrecisionRecipe = ctx.recipe
        dy_NO = dy_NO.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            dy_q = recipe.quantize(dy_NO, recipe.grad_format, -1)
            w_q = recipe.quantize(w_EOI, recipe.forward_format, 1)
            grad_x = ctx.matmul(dy_q, w_q.transpose(1, 2), offsets_E)
        if ctx.needs_input_grad[1]:
            block_ids = recipe.token_block_ids(offsets_E, x_NI.shape[0])
            dy_q = recipe.quantize(dy_NO, recipe.grad_format, 0, block_ids)
            x_q = recipe.quantize(x_NI, recipe.forward_format, 0, block_ids)
            grad_w = _weight_gradient(dy_q, x_q, offsets_E, w_EOI.shape[0])
        return grad_x, grad_w, None, None, None


def _weight_gradient(dy_NO: torch.Tensor, x_NI: torch.Tensor, offsets_E: torch.Tensor, num_experts: int):
    """dw[e] = dy[group e].T @ x[group e], as one grouped GEMM over the token dimension."""
    if x_NI.shape[0] == 0:
        return x_NI.new_zeros(num_experts, dy_NO.shape[1], x_NI.shape[1])
    return torch._grouped_mm(dy_NO.t(), x_NI, offs=offsets_E)
