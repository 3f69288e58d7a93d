"""Low-precision expert GEMMs, portable: the rounding of a native FP8/MXFP8 GEMM, emulated.

The kernel layer knows no number formats. The run's precision layer passes every
call a recipe (the `Recipe` protocol below) that says how each operand of the
forward, the input gradient and the weight gradient is quantized. This
implementation rounds the operands as the recipe prescribes and multiplies them with
the run's chosen high-precision `moe.grouped_mm`, so emulation changes numerics, not
the kernel; a vendor implementation feeds the same quantized elements and scales to
a low-precision GEMM instead.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ferry.kernels.dispatch import reads_group_sizes_on_host


class Recipe(Protocol):
    """How the three GEMMs of an expert layer quantize their operands.

    Formats have a `dtype` (a torch float8 dtype). `quantize` returns the operand
    rounded and dequantized; `quantize_scaled` the elements in the format's dtype and
    their fp32 scales, with `dim` moved last and one entry per block along it.
    """

    kind: str
    forward_format: object
    grad_format: object

    def quantize(self, x: torch.Tensor, fmt, dim: int, block_ids: torch.Tensor | None = None) -> torch.Tensor: ...

    def quantize_scaled(
        self, x: torch.Tensor, fmt, dim: int, block_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def token_block_ids(self, offsets_E: torch.Tensor, num_rows: int) -> torch.Tensor: ...


@reads_group_sizes_on_host
def low_precision_grouped_mm(
    x_NI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor, recipe: Recipe, *, grouped_mm
) -> torch.Tensor:
    """`moe.grouped_mm` with every operand, forward and backward, rounded as `recipe` prescribes."""
    return EmulatedLowPrecisionGroupedMM.apply(x_NI, w_EOI, offsets_E, recipe, grouped_mm)


class EmulatedLowPrecisionGroupedMM(torch.autograd.Function):
    """y[group e] = x[group e] @ w[e].T with every operand rounded as `recipe` prescribes.

    Forward operands are quantized along the reduction dim I; the input gradient's
    along O; the weight gradient's along tokens, in blocks that never cross an
    expert's group. `matmul(x_NI, w_EOI, offsets_E)` is the high-precision grouped GEMM.
    """

    @staticmethod
    def forward(ctx, x_NI, w_EOI, offsets_E, recipe: Recipe, matmul):
        ctx.save_for_backward(x_NI, w_EOI, offsets_E)
        ctx.recipe = recipe
        ctx.matmul = matmul
        fmt = recipe.forward_format
        return matmul(recipe.quantize(x_NI, fmt, -1), recipe.quantize(w_EOI, fmt, -1), offsets_E)

    @staticmethod
    def backward(ctx, dy_NO):
        x_NI, w_EOI, offsets_E = ctx.saved_tensors
        recipe: Recipe = ctx.recipe
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
    """dw[e] = dy[group e].T @ x[group e], one matmul per expert (an empty group's is zero)."""
    grad_EOI = x_NI.new_zeros(num_experts, dy_NO.shape[1], x_NI.shape[1])
    start = 0
    for expert, end in enumerate(offsets_E.tolist()):
        if end > start:
            torch.mm(dy_NO[start:end].t(), x_NI[start:end], out=grad_EOI[expert])
        start = end
    return grad_EOI
