"""Routed gated experts: the weights, stored as 3-D tensors, and the kernel ops that run them."""

from __future__ import annotations

import torch
from torch import nn

from ferry.kernels import KernelSelection, portable_kernels
from ferry.kernels.activation import GatedActivation
from ferry.kernels.amp import in_autocast_dtype
from ferry.model.router import Routing


class Experts(nn.Module):
    """`num_experts` gated MLPs; weights are [num_experts, out, in] like stacked nn.Linear weights.

    The tensors keep their own names (`w_gate_EFD`, `w_up_EFD`, `w_down_EDF`; with biases `bias_gate_EF`,
    `bias_up_EF`, `bias_down_ED`): they are the logical checkpoint names, whatever layout a kernel would prefer.
    The plain SwiGLU runs on `moe.expert_mlp` / `moe.routed_experts`; biases or another activation (GPT-OSS's) on
    `moe.biased_expert_mlp`, between the same permutation and combine.
    """

    COMPUTE_WEIGHTS = ("w_gate_EFD", "w_up_EFD", "w_down_EDF")  # cast once a step (`ferry/precision/step_weights.py`)

    def __init__(
        self,
        num_experts: int,
        dim: int,
        ffn_dim: int,
        kernels: KernelSelection | None = None,
        biases: bool = False,
        activation: GatedActivation = GatedActivation(),
    ):
        super().__init__()
        kernels = kernels or portable_kernels()
        self.num_experts = num_experts
        self.w_gate_EFD = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.w_up_EFD = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.w_down_EDF = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        if biases:
            self.bias_gate_EF = nn.Parameter(torch.zeros(num_experts, ffn_dim))
            self.bias_up_EF = nn.Parameter(torch.zeros(num_experts, ffn_dim))
            self.bias_down_ED = nn.Parameter(torch.zeros(num_experts, dim))
        self.has_biases = biases
        self.activation = activation
        self.plain = not biases and activation.kind == "swiglu"
        self._expert_mlp = kernels["moe.expert_mlp"]
        self._biased_expert_mlp = kernels["moe.biased_expert_mlp"]
        self._routed_experts = kernels["moe.routed_experts"]
        self._permute = kernels["moe.permute"]
        self._combine = kernels["moe.combine"]

    def forward(self, x_ND: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """`x_ND` holds the rows of expert 0, then expert 1, ...: what an expert-parallel dispatcher hands over."""
        x_ND, w_gate_EFD, w_up_EFD, w_down_EDF = in_autocast_dtype(
            x_ND, self.w_gate_EFD, self.w_up_EFD, self.w_down_EDF
        )
        if self.plain:
            return self._expert_mlp(x_ND, tokens_per_expert_E, w_gate_EFD, w_up_EFD, w_down_EDF)
        biases = (
            in_autocast_dtype(self.bias_gate_EF, self.bias_up_EF, self.bias_down_ED) if self.has_biases else (None,) * 3
        )
        return self._biased_expert_mlp(
            x_ND, tokens_per_expert_E, w_gate_EFD, w_up_EFD, w_down_EDF, *biases, self.activation
        )

    def routed(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Every token through its routed experts, summed with its routing weights, all experts local."""
        if not self.plain:
            x_TD, weights_TK = in_autocast_dtype(x_TD, routing.weights_TK)
            x_ND, dispatch = self._permute(x_TD, routing.expert_ids_TK)
            return self._combine(self(x_ND, routing.tokens_per_expert_E), weights_TK, dispatch)
        x_TD, weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF = in_autocast_dtype(
            x_TD, routing.weights_TK, self.w_gate_EFD, self.w_up_EFD, self.w_down_EDF
        )
        return self._routed_experts(
            x_TD, routing.expert_ids_TK, weights_TK, routing.tokens_per_expert_E, w_gate_EFD, w_up_EFD, w_down_EDF
        )
