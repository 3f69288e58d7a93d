"""Dense SwiGLU feed-forward (dense layers and the MoE shared expert)."""

import torch
import torch.nn.functional as F
from torch import nn

from ferry.kernels import KernelSelection
from ferry.model.linear import Linear


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden_dim: int, kernels: KernelSelection | None = None):
        super().__init__()
        self.w_gate = Linear(dim, hidden_dim, kernels)
        self.w_up = Linear(dim, hidden_dim, kernels)
        self.w_down = Linear(hidden_dim, dim, kernels)

    def forward(self, x_XD: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x_XD)) * self.w_up(x_XD))
