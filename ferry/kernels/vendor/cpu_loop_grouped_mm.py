"""`moe.grouped_mm` for CPUs in bfloat16/float16: the portable per-expert loop, input gradient column-major.

The portable loop's backward computes each group's input gradient as grad @ w with
both operands row-major, the layout that runs at a tenth of the speed on CPUs
without bfloat16 units (`cpu_gemm_layout`). This is the same loop with each expert's
weight copied column-major for that GEMM. It serves the expert-parallel path
(`moe.expert_mlp`), which a local CPU run does not take (`fused_loop` fuses it).
"""

from __future__ import annotations

import torch

from ferry.kernels.amp import outside_autocast
from ferry.kernels.dispatch import reads_group_sizes_on_host
from ferry.kernels.portable.moe import loop_grouped_mm
from ferry.kernels.vendor.cpu_gemm_layout import REDUCED_DTYPES, fast_right_operand


def probe(device: torch.device, dtype: torch.dtype) -> str | None:
    if dtype not in REDUCED_DTYPES:
        return f"it only changes the GEMM layouts of bfloat16/float16; in {dtype} the portable loop is as fast"
    return None


@reads_group_sizes_on_host
@outside_autocast
def grouped_mm(x_NI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    return loop_grouped_mm(x_NI, w_EOI, offsets_E, input_grad_weight=fast_right_operand)
