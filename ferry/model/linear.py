"""The model's dense projections: `nn.Linear` parameters whose matmul is the `linear` kernel op."""

from __future__ import annotations

import torch
from torch import nn

from ferry.kernels import KernelSelection, portable_kernels
from ferry.kernels.amp import in_autocast_dtype


class Linear(nn.Linear):
    """An `nn.Linear` (same parameters, same state-dict keys) whose matmul is the selected `linear` op; bias-free
    unless asked (GPT-OSS's attention projections have one), the bias then added after the op.

    The op runs outside autocast, so the operands are cast here to autocast's dtype,
    as autocast would have cast them for `F.linear`.
    """

    COMPUTE_WEIGHTS = ("weight",)  # cast once a step under autocast (`ferry/precision/step_weights.py`)

    def __init__(self, in_features: int, out_features: int, kernels: KernelSelection | None = None, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self._linear = (kernels or portable_kernels())["linear"]

    def forward(self, x_XI: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return self._linear(*in_autocast_dtype(x_XI, self.weight))
        x_XI, w_OI, b_O = in_autocast_dtype(x_XI, self.weight, self.bias)
        return self._linear(x_XI, w_OI) + b_O
