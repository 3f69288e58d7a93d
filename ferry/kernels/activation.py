"""The gated activations an expert applies between its up and down projections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class GatedActivation:
    """`swiglu`: silu(gate) * up. `clamped_swiglu` (GPT-OSS): the gate clamped above and the up projection on both
    sides at `limit`, then gate * sigmoid(alpha * gate) * (up + 1); the clamps bound what a bf16 expert may
    produce, and the + 1 lets an expert pass its gate through where up is zero."""

    kind: Literal["swiglu", "clamped_swiglu"] = "swiglu"
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate_NF: torch.Tensor, up_NF: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return F.silu(gate_NF) * up_NF
        gate_NF = gate_NF.clamp(max=self.limit)
        up_NF = up_NF.clamp(min=-self.limit, max=self.limit)
        return gate_NF * torch.sigmoid(self.alpha * gate_NF) * (up_NF + 1)
