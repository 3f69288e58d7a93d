"""Portable attention: PyTorch's scaled-dot-product attention, which every backend implements."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(q_BHSC: torch.Tensor, k_BGSC: torch.Tensor, v_BGSC: torch.Tensor) -> torch.Tensor:
    """Softmax(q k^T / sqrt(C) + causal mask) v; G key/value heads each serve H/G query heads."""
    return F.scaled_dot_product_attention(
        q_BHSC, k_BGSC, v_BGSC, is_causal=True, enable_gqa=k_BGSC.shape[1] != q_BHSC.shape[1]
    )


def masked_attention(
    q_BHSC: torch.Tensor, k_BGTC: torch.Tensor, v_BGTC: torch.Tensor, visible_BST: torch.Tensor
) -> torch.Tensor:
    """Softmax(q k^T / sqrt(C) over the keys `visible_BST` allows) v: decoding against a key/value cache,
    where S new queries see T cached keys and padded slots are hidden."""
    return F.scaled_dot_product_attention(
        q_BHSC, k_BGTC, v_BGTC, attn_mask=visible_BST[:, None], enable_gqa=k_BGTC.shape[1] != q_BHSC.shape[1]
    )
