"""`moe.grouped_mm` on the `grouped_gemm` package: the CUTLASS grouped GEMM that MegaBlocks uses.

The CUDA vendor path: `pip install grouped_gemm` (built against the local CUDA
toolkit). It takes bfloat16 only and wants the group sizes as a host tensor.
"""

from __future__ import annotations

import importlib.util

import torch

from ferry.kernels.amp import outside_autocast
from ferry.kernels.dispatch import reads_group_sizes_on_host


def probe(device: torch.device, dtype: torch.dtype) -> str | None:
    if importlib.util.find_spec("grouped_gemm") is None:
        return "the grouped_gemm package is not installed (pip install grouped_gemm)"
    if dtype != torch.bfloat16:
        return f"it takes bfloat16, not {dtype}"
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 0):
        return f"it needs compute capability 8.0 or newer, this GPU has {capability[0]}.{capability[1]}"
    return None


@reads_group_sizes_on_host
@outside_autocast
def grouped_mm(x_NI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    from grouped_gemm.ops import gmm

    batch_sizes_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1)).to("cpu", torch.int64)
    return gmm(x_NI, w_EOI.contiguous(), batch_sizes_E, trans_b=True)
