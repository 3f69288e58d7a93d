"""The mixture-of-experts feed-forward layer: route, dispatch (dropless), run experts, combine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from ferry.model.config import MoEConfig
from ferry.model.experts import Experts
from ferry.model.feedforward import SwiGLU
from ferry.model.router import Router


class ExpertDispatcher(Protocol):
    """Runs expert-sorted tokens through experts that may live elsewhere (set by the parallel layer)."""

    def __call__(self, x_ND: torch.Tensor, tokens_per_expert_E: torch.Tensor, experts: nn.Module) -> torch.Tensor: ...


@dataclass
class MoEStats:
    """What one MoE layer reports per forward: its losses and how many tokens each expert got."""

    tokens_per_expert_E: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    mean_prob_E: torch.Tensor
    entropy: torch.Tensor


class MoELayer(nn.Module):
    """Dropless top-k MoE with an optional shared expert.

    Dispatch sorts the T*K (token, expert) assignments by expert so every expert sees
    one contiguous group; the combine puts results back in assignment order and sums
    each token's K outputs weighted by its routing weights. No token is ever dropped.
    """

    def __init__(self, dim: int, config: MoEConfig):
        super().__init__()
        self.top_k = config.top_k
        self.router = Router(dim, config)
        self.experts = Experts(config.num_experts, dim, config.expert_ffn_dim)
        self.shared_expert = SwiGLU(dim, config.shared_expert_ffn_dim) if config.shared_expert_ffn_dim else None
        self.dispatcher: ExpertDispatcher | None = None

    def run_experts(self, x_ND: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """Local experts, or the parallel layer's dispatcher when experts live on several ranks."""
        if self.dispatcher is None:
            return self.experts(x_ND, tokens_per_expert_E)
        return self.dispatcher(x_ND, tokens_per_expert_E, self.experts)

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, MoEStats]:
        batch, seq_len, dim = x_BSD.shape
        x_TD = x_BSD.reshape(-1, dim)
        routing = self.router(x_TD)
        order_N = torch.argsort(routing.expert_ids_TK.flatten(), stable=True)
        token_of_N = torch.div(order_N, self.top_k, rounding_mode="floor")
        y_ND = self.run_experts(x_TD[token_of_N], routing.tokens_per_expert_E)
        inverse_order_N = torch.empty_like(order_N)
        inverse_order_N[order_N] = torch.arange(order_N.numel(), device=order_N.device)
        y_TKD = y_ND[inverse_order_N].view(-1, self.top_k, dim)
        out_TD = torch.bmm(routing.weights_TK.unsqueeze(1), y_TKD).squeeze(1)
        if self.shared_expert is not None:
            out_TD = out_TD + self.shared_expert(x_TD)
        stats = MoEStats(
            routing.tokens_per_expert_E, routing.aux_loss, routing.z_loss, routing.mean_prob_E, routing.entropy
        )
        return out_TD.view(batch, seq_len, dim), stats
