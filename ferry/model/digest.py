"""A digest of a model's weights: two runs (or two machines) started from the same values, or not.

Initial weights are drawn whole on the CPU from `run.seed` (before the model moves to its
device or is split over ranks; for a run that resumed from nothing, after, each rank taking
its piece), so the same seed gives the same values everywhere; this digest is how a
benchmark or a rehearsal shows it rather than assumes it.
"""

from __future__ import annotations

import torch
import xxhash
from torch import nn


def weights_digest(model: nn.Module) -> str:
    """xxh3-128 over every state-dict entry's name, dtype, shape and bytes, in name order."""
    digest = xxhash.xxh3_128()
    for name, tensor in sorted(model.state_dict().items()):
        local = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{local.dtype}|{tuple(local.shape)}|".encode())
        digest.update(local.view(torch.uint8).numpy().tobytes() if local.numel() else b"")
    return digest.hexdigest()
