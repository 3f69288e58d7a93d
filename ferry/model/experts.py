"""Routed SwiGLU experts stored as 3-D tensors and run as grouped GEMMs over sorted tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Experts(nn.Module):
    """`num_experts` SwiGLU MLPs; weights are [num_experts, out, in] like stacked nn.Linear weights."""

    def __init__(self, num_experts: int, dim: int, ffn_dim: int):
        super().__init__()
        self.num_experts = num_experts
        self.w_gate_EFD = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.w_up_EFD = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.w_down_EDF = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))

    def forward(self, x_ND: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """`x_ND` holds the tokens of expert 0, then expert 1, ...; counts say where each group ends."""
        offsets_E = torch.cumsum(tokens_per_expert_E, dim=0, dtype=torch.int32)
        gate_NF = grouped_mm(x_ND, self.w_gate_EFD, offsets_E)
        up_NF = grouped_mm(x_ND, self.w_up_EFD, offsets_E)
        return grouped_mm(F.silu(gate_NF) * up_NF, self.w_down_EDF, offsets_E)


def grouped_mm(x_NI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """y[rows of group e] = x[rows of group e] @ w[e].T, one fused call for all groups."""
    return torch._grouped_mm(x_NI, w_EOI.transpose(-2, -1), offs=offsets_E)
