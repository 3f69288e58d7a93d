"""RMSNorm."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learned scale, computed in fp32 for stability."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x_XD: torch.Tensor) -> torch.Tensor:
        x32_XD = x_XD.float()
        normed_XD = x32_XD * torch.rsqrt(x32_XD.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed_XD.to(x_XD.dtype)
