"""Routed SwiGLU experts: the weights, stored as 3-D tensors, and the kernel ops that run them."""

from __future__ import annotations

import torch
from torch import nn

from ferry.kernels import KernelSelection, portable_kernels
from ferry.kernels.amp import in_autocast_dtype
from ferry.model.router import Routing


class Experts(nn.Module):
    """`num_experts` SwiGLU MLPs; weights are [num_experts, out, in] like stacked nn.Linear weights.

    The tensors keep their own names (`w_gate_EFD`, `w_up_EFD`, `w_down_EDF`): they
    are the logical checkpoint names, whatever layout a kernel would prefer.
    """

    COMPUTE_WEIGHTS = ("w_gate_EFD", "w_up_EFD", "w_down_EDF")  # cast once a step (`ferry/precision/step_weights.py`)

    def __init__(self, num_experts: int, dim: int, ffn_dim: int, kernels: KernelSelection | None = None):
        super().__init__()
        kernels = kernels or portable_kernels()
        self.num_experts = num_experts
        self.w_gate_EFD = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.w_up_EFD = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.w_down_EDF = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self._expert_mlp = kernels["moe.expert_mlp"]
        self._routed_experts = kernels["moe.routed_experts"]

    def forward(self, x_ND: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """`x_ND` holds the rows of expert 0, then expert 1, ...: what an expert-parallel dispatcher hands over."""
        x_ND, w_gate_EFD, w_up_EFD, w_down_EDF = in_autocast_dtype(
            x_ND, self.w_gate_EFD, self.w_up_EFD, self.w_down_EDF
        )
        return self._expert_mlp(x_ND, tokens_per_expert_E, w_gate_EFD, w_up_EFD, w_down_EDF)

    def routed(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Every token through its routed experts, summed with its routing weights, all experts local."""
        x_TD, weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF = in_autocast_dtype(
            x_TD, routing.weights_TK, self.w_gate_EFD, self.w_up_EFD, self.w_down_EDF
        )
        return self._routed_experts(
            x_TD, routing.expert_ids_TK, weights_TK, routing.tokens_per_expert_E, w_gate_EFD, w_up_EFD, w_down_EDF
        )

