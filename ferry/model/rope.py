"""Rotary position embedding (the rotate-half convention that Llama and OLMoE checkpoints use), with the
frequency scalings that extend a model's context (`RopeScalingConfig`)."""

import math

import torch
from torch import nn

from ferry.model.rope_config import RopeScalingConfig


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables up to `max_seq_len`; applied to queries and keys."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float, scaling: RopeScalingConfig | None = None):
        super().__init__()
        scaling = scaling or RopeScalingConfig()
        inv_freq_C2 = scaled_inverse_frequencies(head_dim, theta, scaling)
        positions_S = torch.arange(max_seq_len, dtype=torch.float64)
        angles_SC2 = torch.outer(positions_S, inv_freq_C2)
        angles_SC = torch.cat([angles_SC2, angles_SC2], dim=-1)
        attention_factor = scaling.attention_factor
        self.register_buffer("cos_SC", (angles_SC.cos() * attention_factor).float(), persistent=False)
        self.register_buffer("sin_SC", (angles_SC.sin() * attention_factor).float(), persistent=False)

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


def scaled_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScalingConfig) -> torch.Tensor:
    """theta^(-2i/C) for i < C/2, in float64, after the configured scaling.

    YaRN's ramp runs over the dimensions between the ones that turn `beta_fast` and
    `beta_slow` times over the original length, `d(r) = C ln(L / (2 pi r)) / (2 ln theta)`,
    floored and ceiled as in the paper's reference code (and transformers), or exact with
    `truncate: false` (GPT-OSS's form).
    """
    inv_freq_C2 = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling.kind == "linear":
        return inv_freq_C2 / scaling.factor
    if scaling.kind == "yarn":
        original = scaling.original_max_seq_len

        def dimension(rotations: float) -> float:
            return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
        if scaling.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        high = high + 0.001 if low == high else high
        ramp_C2 = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0.0, 1.0)
        keep_C2 = 1.0 - ramp_C2  # 1: the frequency is kept (extrapolated), 0: interpolated
        return inv_freq_C2 / scaling.factor * (1.0 - keep_C2) + inv_freq_C2 * keep_C2
    return inv_freq_C2


def _rotate_half(x_XC: torch.Tensor) -> torch.Tensor:
    first, second = x_XC.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)
