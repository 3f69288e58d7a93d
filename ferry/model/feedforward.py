"""Dense SwiGLU feed-forward (dense layers and the MoE shared expert)."""

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w_gate = nn.Linear(dim, hidden_dim, bias=False)
        self.w_up = nn.Linear(dim, hidden_dim, bias=False)
        self.w_down = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x_XD: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x_XD)) * self.w_up(x_XD))
