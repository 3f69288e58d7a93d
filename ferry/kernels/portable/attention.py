"""Portable attention: PyTorch's scaled-dot-product attention, which every backend implements."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(
    q_BHSC: torch.Tensor, k_BGSC: torch.Tensor, v_BGSE: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Softmax(q k^T * scale + causal mask) v, scale 1/sqrt(C) unless given (MLA's YaRN sharpens it); G
    key/value heads each serve H/G query heads; the value width E may differ from C."""
    out_BHSC = F.scaled_dot_product_attention(
        q_BHSC,
        k_BGSC,
        _as_wide_as(v_BGSE, q_BHSC),
        is_causal=True,
        scale=scale,
        enable_gqa=k_BGSC.shape[1] != q_BHSC.shape[1],
    )
    return _narrowed_to(out_BHSC, v_BGSE)


def masked_attention(
    q_BHSC: torch.Tensor,
    k_BGTC: torch.Tensor,
    v_BGTE: torch.Tensor,
    visible_BST: torch.Tensor,
    scale: float | None = None,
    sinks_H: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax(q k^T * scale over the keys `visible_BST` allows) v, scale 1/sqrt(C) unless given: decoding
    against a key/value cache, where S new queries see T cached keys and padded slots are hidden; a window or
    document masks. With `sinks_H`, head h's softmax over a row has one more logit, `sinks_H[h]`, whose value is
    zero (GPT-OSS's attention sinks)."""
    if sinks_H is not None:
        return _attention_with_sinks(q_BHSC, k_BGTC, v_BGTE, visible_BST, sinks_H, scale)
    out_BHSC = F.scaled_dot_product_attention(
        q_BHSC,
        k_BGTC,
        _as_wide_as(v_BGTE, q_BHSC),
        attn_mask=visible_BST[:, None],
        scale=scale,
        enable_gqa=k_BGTC.shape[1] != q_BHSC.shape[1],
    )
    return _narrowed_to(out_BHSC, v_BGTE)


def _attention_with_sinks(
    q_BHSC: torch.Tensor,
    k_BGTC: torch.Tensor,
    v_BGTE: torch.Tensor,
    visible_BST: torch.Tensor,
    sinks_H: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """The sinks' softmax written out: scaled dot-product attention has no place for a logit without a key. Each
    key/value head serves its P = H / G query heads as one group, without copying its keys; the softmax runs in
    fp32. It keeps the S x T probabilities of every head for the backward, as the unfused path always does."""
    batch, heads, seq_len, width = q_BHSC.shape
    groups = k_BGTC.shape[1]
    scale = width**-0.5 if scale is None else scale
    q_BGPSC = q_BHSC.view(batch, groups, heads // groups, seq_len, width)
    logits_BGPST = torch.einsum("bgpsc,bgtc->bgpst", q_BGPSC, k_BGTC).float() * scale
    logits_BGPST = logits_BGPST.masked_fill(~visible_BST[:, None, None], float("-inf"))
    sinks_BGPS1 = sinks_H.float().view(1, groups, heads // groups, 1, 1).expand(*logits_BGPST.shape[:-1], 1)
    probs_BGPST = torch.cat([logits_BGPST, sinks_BGPS1], dim=-1).softmax(dim=-1)[..., :-1]
    out_BGPSE = torch.einsum("bgpst,bgte->bgpse", probs_BGPST.to(v_BGTE.dtype), v_BGTE)
    return out_BGPSE.reshape(batch, heads, seq_len, -1)


def _as_wide_as(v_BGTE: torch.Tensor, q_BHSC: torch.Tensor) -> torch.Tensor:
    """Values padded with zero columns to the query/key width C (MLA's values are narrower).

    The fused SDPA kernels take one head width for queries, keys and values; with another value width
    the CPU falls back to the unfused path, which keeps every head's S x S attention weights for the
    backward (5 KB a token and layer at 256 tokens, 80 KB at 4,096 for DeepSeek-V3's 128 heads), where the
    fused path keeps a few numbers a row. The zero columns come out as zeros and are sliced off.
    """
    missing = q_BHSC.shape[-1] - v_BGTE.shape[-1]
    return F.pad(v_BGTE, (0, missing)) if missing > 0 else v_BGTE


def _narrowed_to(out_BHSC: torch.Tensor, v_BGTE: torch.Tensor) -> torch.Tensor:
    """The output without the padded value columns (the tensor itself when there were none)."""
    return out_BHSC[..., : v_BGTE.shape[-1]] if out_BHSC.shape[-1] != v_BGTE.shape[-1] else out_BHSC
