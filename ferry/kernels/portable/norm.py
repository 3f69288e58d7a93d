"""Portable RMSNorm."""

from __future__ import annotations

import torch


def rms_norm(x_XD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps), the statistics in fp32 whatever the input dtype."""
    x32_XD = x_XD.float()
    normed_XD = x32_XD * torch.rsqrt(x32_XD.pow(2).mean(-1, keepdim=True) + eps)
    return weight_D * normed_XD.to(x_XD.dtype)
