"""`linear` for CPUs in bfloat16/float16: the input gradient from a column-major copy of the weight.

Autograd's linear backward computes the input gradient as grad @ w, both operands
row-major, the layout that runs at a tenth of the speed on CPUs without bfloat16
units (`cpu_gemm_layout`): a bfloat16 rehearsal on such a CPU spent most of its step
in the output head's and the projections' input gradients. The forward (x @ w.T) and
the weight gradient (grad.T @ x) already take fast layouts. In float32 every layout
is fast, hence bfloat16 and float16 only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ferry.kernels.amp import outside_autocast
from ferry.kernels.vendor.cpu_gemm_layout import REDUCED_DTYPES, fast_right_operand


def probe(device: torch.device, dtype: torch.dtype) -> str | None:
    if dtype not in REDUCED_DTYPES:
        return f"it only changes the GEMM layouts of bfloat16/float16; in {dtype} the portable path is as fast"
    return None


@outside_autocast
def linear(x_XI: torch.Tensor, w_OI: torch.Tensor) -> torch.Tensor:
    return _Linear.apply(x_XI, w_OI)


class _Linear(torch.autograd.Function):
    """F.linear forward; backward with both GEMMs in the layouts the fast CPU kernel takes."""

    @staticmethod
    def forward(ctx, x_XI, w_OI):
        ctx.save_for_backward(x_XI, w_OI)
        return F.linear(x_XI, w_OI)

    @staticmethod
    def backward(ctx, grad_XO):
        x_XI, w_OI = ctx.saved_tensors
        grad_MO = grad_XO.reshape(-1, grad_XO.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(grad_MO, fast_right_operand(w_OI)).view(x_XI.shape)
        if ctx.needs_input_grad[1]:
            grad_w = torch.mm(grad_MO.t(), x_XI.reshape(-1, x_XI.shape[-1]))
        return grad_x, grad_w
