"""The truncated normal that initialises every weight, owned by ferry so that a seed means the same weights
under any PyTorch version.

`torch.nn.init.trunc_normal_` changed its algorithm in PyTorch 2.12 (inverse CDF before, rejection sampling
since), so the same seed gave other initial weights under torch 2.11, which accelerator images still ship,
than under 2.13: a run started on one and rehearsed from scratch on the other did not start from the same
model, and `ferry bench` records of the two never had the same inputs. This draws exactly what the rejection
sampler draws (each round a full tensor of normals, taken where the previous value fell outside the bounds,
until none does), from torch's CPU normal generator, which has not changed.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def truncated_normal_(tensor: torch.Tensor, std: float, bound: float) -> torch.Tensor:
    """Fill `tensor` with Normal(0, std) draws, every one within [-bound, bound], redrawing those outside."""
    low = torch.tensor(-bound, dtype=tensor.dtype).item()  # the bounds as the tensor's dtype represents them
    high = torch.tensor(bound, dtype=tensor.dtype).item()
    values = tensor.normal_(0.0, std)
    while True:
        outside = (values < low) | (values > high)
        if not outside.any():
            break
        values = torch.where(outside, torch.empty_like(values).normal_(0.0, std), values)
    if values is not tensor:
        tensor.copy_(values)
    return tensor
