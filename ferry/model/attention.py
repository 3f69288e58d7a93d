"""Grouped-query causal self-attention on PyTorch SDPA."""

import torch
import torch.nn.functional as F
from torch import nn

from ferry.model.config import ModelConfig
from ferry.model.norm import RMSNorm
from ferry.model.rope import RotaryEmbedding


class Attention(nn.Module):
    """`n_heads` query heads share `n_kv_heads` key/value heads; RoPE on queries and keys."""

    def __init__(self, config: ModelConfig, rope: RotaryEmbedding):
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)
        self.q_norm = RMSNorm(config.n_heads * self.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.n_kv_heads * self.head_dim, config.norm_eps) if config.qk_norm else None
        self.rope = rope

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x_BSD.shape
        q_BSX = self.wq(x_BSD)
        k_BSY = self.wk(x_BSD)
        if self.q_norm is not None:
            q_BSX = self.q_norm(q_BSX)
            k_BSY = self.k_norm(k_BSY)
        q_BHSC = q_BSX.view(batch, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        k_BGSC = k_BSY.view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v_BGSC = self.wv(x_BSD).view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q_BHSC = self.rope(q_BHSC)
        k_BGSC = self.rope(k_BGSC)
        out_BHSC = F.scaled_dot_product_attention(
            q_BHSC, k_BGSC, v_BGSC, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads
        )
        return self.wo(out_BHSC.transpose(1, 2).reshape(batch, seq_len, -1))
