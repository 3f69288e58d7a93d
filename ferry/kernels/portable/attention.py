"""Portable attention: PyTorch's scaled-dot-product attention, which every backend implements."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(
    q_BHSC: torch.Tensor, k_BGSC: torch.Tensor, v_BGSE: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Softmax(q k^T * scale + causal mask) v, scale 1/sqrt(C) unless given (MLA's YaRN sharpens it); G
    key/value heads each serve H/G query heads; the value width E may differ from C."""
    return F.scaled_dot_product_attention(
        q_BHSC, k_BGSC, v_BGSE, is_causal=True, scale=scale, enable_gqa=k_BGSC.shape[1] != q_BHSC.shape[1]
    )


def masked_attention(
    q_BHSC: torch.Tensor,
    k_BGTC: torch.Tensor,
    v_BGTE: torch.Tensor,
    visible_BST: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Softmax(q k^T * scale over the keys `visible_BST` allows) v, scale 1/sqrt(C) unless given: decoding
    against a key/value cache, where S new queries see T cached keys and padded slots are hidden."""
    return F.scaled_dot_product_attention(
        q_BHSC, k_BGTC, v_BGTE, attn_mask=visible_BST[:, None], scale=scale,
        enable_gqa=k_BGTC.shape[1] != q_BHSC.shape[1],
    )
