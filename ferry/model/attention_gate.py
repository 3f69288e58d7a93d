"""The sigmoid output gate of gated attention: each head's output (or each of its elements) scaled by a gate
computed from the attention's input, which lets a head say "nothing here" without a sink token."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ferry.kernels import KernelSelection
from ferry.model.linear import Linear

if TYPE_CHECKING:
    from ferry.model.variants.base import ModelShape


class OutputGate(nn.Module):
    """out_BSHE * sigmoid(x_BSD W): W gives one value per head (`head`) or per output element (`elementwise`)."""

    def __init__(self, dim: int, n_heads: int, head_width: int, kind: str, kernels: KernelSelection | None = None):
        super().__init__()
        self.per_element = kind == "elementwise"
        self.n_heads = n_heads
        self.w_gate = Linear(dim, n_heads * head_width if self.per_element else n_heads, kernels)

    def forward(self, x_BSD: torch.Tensor, out_BSHE: torch.Tensor) -> torch.Tensor:
        gate_BSX = torch.sigmoid(self.w_gate(x_BSD))
        if self.per_element:
            return out_BSHE * gate_BSX.view(out_BSHE.shape)
        return out_BSHE * gate_BSX.view(*out_BSHE.shape[:2], self.n_heads, 1)


def build_output_gate(
    config: ModelShape, n_heads: int, head_width: int, kernels: KernelSelection | None
) -> OutputGate | None:
    """The gate `config.attention_gate` asks for, or None."""
    if config.attention_gate == "none":
        return None
    return OutputGate(config.dim, n_heads, head_width, config.attention_gate, kernels)
