"""The GEMM operand layout CPU bfloat16/float16 matmuls need to run at speed; shared by the CPU kernels.

On a CPU without bfloat16 matrix units (AVX2, no AVX-512 BF16 or AMX) torch runs a
reduced-precision GEMM whose operands are both row-major (grad @ w: autograd's input
gradient of a linear layer) through a reference kernel at about 1.3 GFLOP/s, a tenth
of what the same product reaches when its right operand is column-major (a transposed
view of a contiguous matrix). A column-major copy of the weight costs one pass over it.
"""

from __future__ import annotations

import torch

REDUCED_DTYPES = (torch.bfloat16, torch.float16)


def fast_right_operand(b_KN: torch.Tensor) -> torch.Tensor:
    """The same matrix as `b_KN`, laid out column-major where the fast reduced-precision GEMM wants it."""
    if b_KN.dtype not in REDUCED_DTYPES:
        return b_KN
    return b_KN.t().contiguous().t()
