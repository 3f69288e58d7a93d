"""`moe.grouped_mm` on `torch._grouped_mm`: one fused grouped GEMM call per matmul.

Tied to platforms because the op is: a CPU kernel exists since torch 2.9, the CUDA
one runs CUTLASS grouped GEMMs on compute capability 9.0+ in bfloat16, and the
kernel needs every row stride to be a multiple of 16 bytes.
"""

from __future__ import annotations

import torch

from ferry.config import UserError
from ferry.kernels.amp import outside_autocast

_ALIGNMENT_BYTES = 16


def probe_cpu(device: torch.device, dtype: torch.dtype) -> str | None:
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no _grouped_mm (it needs torch 2.9 or newer)"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"its CPU kernel takes float32 or bfloat16, not {dtype}"
    return None


def probe_cuda(device: torch.device, dtype: torch.dtype) -> str | None:
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no _grouped_mm (it needs torch 2.9 or newer)"
    if dtype != torch.bfloat16:
        return f"its CUDA kernel takes bfloat16, not {dtype}"
    capability = torch.cuda.get_device_capability(device)
    if capability < (9, 0):
        return f"its CUDA kernel needs compute capability 9.0 or newer, this GPU has {capability[0]}.{capability[1]}"
    return None


@outside_autocast
def grouped_mm(x_NI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    _check_alignment(x_NI, w_EOI)
    if x_NI.dtype != torch.bfloat16:
        return _untraced(x_NI, w_EOI, offsets_E)
    return _TorchGroupedMM.apply(x_NI, w_EOI, offsets_E)


@torch.compiler.disable
def _untraced(x_NI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """The CPU kernel in float32, outside compiled regions: the shape function that compilation traces
    with (torch 2.13) accepts bfloat16 only, though the CPU kernel computes float32 too."""
    return _TorchGroupedMM.apply(x_NI, w_EOI, offsets_E)


class _TorchGroupedMM(torch.autograd.Function):
    """Forward and both gradients as grouped GEMMs; the gradient is made contiguous first.

    Autograd hands `.sum()`'s gradient over as an expanded tensor with zero strides,
    which `torch._grouped_mm` rejects ("Invalid strides/sizes"), so the backward
    cannot be left to the op's own derivative.
    """

    @staticmethod
    def forward(ctx, x_NI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_NI, w_EOI, offsets_E)
        return torch._grouped_mm(x_NI, w_EOI.transpose(-2, -1), offs=offsets_E)

    @staticmethod
    def backward(ctx, grad_NO: torch.Tensor):
        x_NI, w_EOI, offsets_E = ctx.saved_tensors
        grad_NO = grad_NO.contiguous()
        grad_x_NI = grad_w_EOI = None
        if ctx.needs_input_grad[0]:
            grad_x_NI = torch._grouped_mm(grad_NO, w_EOI, offs=offsets_E)
        if ctx.needs_input_grad[1]:
            grad_w_EOI = torch._grouped_mm(grad_NO.t(), x_NI, offs=offsets_E)
            # an expert without rows has a zero gradient, which not every kernel writes
            empty_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1)) == 0
            grad_w_EOI = grad_w_EOI.masked_fill(empty_E.view(-1, 1, 1), 0.0)
        return grad_x_NI, grad_w_EOI, None


def _check_alignment(x_NI: torch.Tensor, w_EOI: torch.Tensor) -> None:
    values = _ALIGNMENT_BYTES // x_NI.element_size()
    in_width, out_width = w_EOI.shape[2], w_EOI.shape[1]
    if in_width % values or out_width % values:
        raise UserError(
            f"moe.grouped_mm torch_grouped_mm needs widths that are multiples of {values} {x_NI.dtype} values "
            f"(16 bytes), got in {in_width} and out {out_width} (model.dim, model.moe.expert_ffn_dim): make them "
            f'multiples of {values}, or pin kernels.ops."moe.grouped_mm" to portable'
        )
