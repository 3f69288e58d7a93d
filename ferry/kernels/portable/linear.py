"""Portable linear projection (no bias): the dense layers' matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ferry.kernels.amp import outside_autocast


@outside_autocast
def linear(x_XI: torch.Tensor, w_OI: torch.Tensor) -> torch.Tensor:
    """x @ w.T over the last dim, in the dtype of the operands (the caller casts them to the compute dtype)."""
    return F.linear(x_XI, w_OI)
