"""Rotary position embedding (the rotate-half convention that Llama and OLMoE checkpoints use)."""

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables up to `max_seq_len`; applied to queries and keys."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float):
        super().__init__()
        inv_freq_C2 = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        positions_S = torch.arange(max_seq_len, dtype=torch.float64)
        angles_SC2 = torch.outer(positions_S, inv_freq_C2)
        angles_SC = torch.cat([angles_SC2, angles_SC2], dim=-1)
        self.register_buffer("cos_SC", angles_SC.cos().float(), persistent=False)
        self.register_buffer("sin_SC", angles_SC.sin().float(), persistent=False)

    def forward(self, x_BHSC: torch.Tensor, positions_BS: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate by positions 0..S-1, or by each row's own `positions_BS` (decoding with a cache)."""
        if positions_BS is None:
            seq_len = x_BHSC.shape[-2]
            cos = self.cos_SC[:seq_len].to(x_BHSC.dtype)
            sin = self.sin_SC[:seq_len].to(x_BHSC.dtype)
        else:
            cos = self.cos_SC[positions_BS].to(x_BHSC.dtype)[:, None]
            sin = self.sin_SC[positions_BS].to(x_BHSC.dtype)[:, None]
        return x_BHSC * cos + _rotate_half(x_BHSC) * sin


def _rotate_half(x_XC: torch.Tensor) -> torch.Tensor:
    first, second = x_XC.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)
