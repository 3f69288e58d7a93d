"""RMSNorm."""

from __future__ import annotations

import torch
from torch import nn

from ferry.kernels import KernelSelection, portable_kernels


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learned scale, computed by the `norm.rms` op."""

    def __init__(self, dim: int, eps: float, kernels: KernelSelection | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self._rms_norm = (kernels or portable_kernels())["norm.rms"]

    def forward(self, x_XD: torch.Tensor) -> torch.Tensor:
        return self._rms_norm(x_XD, self.weight, self.eps)
