"""The truncated normal that initialises every weight, owned by ferry so that a seed means the same weights
under any PyTorch version.

`torch.nn.init.trunc_normal_` changed its algorithm in PyTorch 2.12 (inverse CDF before, rejection sampling
since), so the same seed gave other initial weights under torch 2.11, which accelerator images still ship,
than under 2.13: a run started on one and rehearsed from scratch on the other did not start from the same
model, and `ferry bench` records of the two never had the same inputs. This draws exactly what the rejection
sampler draws (each round a full tensor of normals, taken where the previous value fell outside the bounds,
until none does), from torch's CPU normal generator, which has not changed, in under half its time.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def truncated_normal_(tensor: torch.Tensor, std: float, bound: float) -> torch.Tensor:
    """Fill `tensor` with Normal(0, std) draws, every one within [-bound, bound], redrawing those outside.

    Each round draws a whole tensor of normals, as the rejection sampler does (the generator must advance
    as it does), but only the positions still outside are read from it and written, where the sampler's
    rounds compare, select and copy the whole tensor each time. The same values for a contiguous tensor
    (every parameter); a strided view gets its draws in its logical order instead of its memory order.
    """
    low = torch.tensor(-bound, dtype=tensor.dtype).item()  # the bounds as the tensor's dtype represents them
    high = torch.tensor(bound, dtype=tensor.dtype).item()
    values = tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
    flat = values.view(-1).normal_(0.0, std)
    redraw = ((flat < low) | (flat > high)).nonzero().squeeze(1)
    round_draw = torch.empty_like(flat) if redraw.numel() else None
    while redraw.numel():
        drawn = round_draw.normal_(0.0, std)[redraw]
        flat[redraw] = drawn
        redraw = redraw[(drawn < low) | (drawn > high)]
    if values is not tensor:
        tensor.copy_(values)
    return tensor
