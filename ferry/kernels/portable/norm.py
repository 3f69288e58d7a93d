"""Portable RMSNorm, with a backward of its own.

Autograd's backward of the plain formula walks the activation about a dozen times (the square, the mean's
expand, both products and their sums) and keeps the normalised activation alive for the weight's
gradient. The backward here is the closed form, in plain tensor ops that every backend runs:

    n = x * r,  r = rsqrt(mean(x^2) + eps),  y = w * n
    dw = sum over rows of dy * n
    dx = r * (g - n * mean(g * n)),  g = dy * w

which keeps only the input and the per-row `r` from the forward, and recomputes `n` from them.
"""

from __future__ import annotations

import torch


def rms_norm(x_XD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps), the statistics in fp32 whatever the input dtype."""
    return _RMSNorm.apply(x_XD, weight_D, eps)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_XD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
        x32_XD = x_XD.float()
        rstd_X1 = torch.rsqrt(x32_XD.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x_XD, weight_D, rstd_X1)
        return weight_D * (x32_XD * rstd_X1).to(x_XD.dtype)

    @staticmethod
    def backward(ctx, grad_XD: torch.Tensor):
        x_XD, weight_D, rstd_X1 = ctx.saved_tensors
        normed32_XD = x_XD.float() * rstd_X1
        grad_x = grad_weight = None
        if ctx.needs_input_grad[1]:
            normed_XD = normed32_XD.to(x_XD.dtype)
            grad_weight = (grad_XD * normed_XD).reshape(-1, grad_XD.shape[-1]).sum(0).to(weight_D.dtype)
        if ctx.needs_input_grad[0]:
            grad_normed32_XD = (grad_XD * weight_D).to(x_XD.dtype).float()
            mean_X1 = (grad_normed32_XD * normed32_XD).mean(-1, keepdim=True)
            grad_x = grad_normed32_XD.addcmul_(normed32_XD, mean_X1, value=-1.0).mul_(rstd_X1).to(x_XD.dtype)
        return grad_x, grad_weight, None
