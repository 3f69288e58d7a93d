"""Multi-head latent attention (DeepSeek-V2/V3), optionally gated; the attention itself is the `attention` op.

Every head's keys and values are expanded from one small latent per token (`kv_lora_rank` wide,
RMS-normalised), so a decoding cache keeps the latent alone. RoPE cannot pass through that
expansion, so position enters through a separate rotary part: each head's query has its own
`qk_rope_head_dim` rotary slice, and one rotary key slice, computed beside the latent, serves every
head. Queries may pass through a low-rank latent of their own (`q_lora_rank`), which saves parameters
and activation memory but nothing in the cache.

Shapes: B batch, S new tokens, T cached tokens, H heads, D model width, L the key/value latent,
R the rotary part, N the position-free query/key part, K = N + R, E the value width.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from ferry.kernels import KernelSelection, portable_kernels
from ferry.model.attention_gate import build_output_gate
from ferry.model.kv_cache import LayerCache
from ferry.model.linear import Linear
from ferry.model.max_logit import MaxLogits
from ferry.model.norm import RMSNorm
from ferry.model.rope import RotaryEmbedding
from ferry.model.sequence_split import SequenceSplit

if TYPE_CHECKING:
    from ferry.model.variants.base import ModelShape


class LatentAttention(nn.Module):
    """MLA with the softmax scale DeepSeek uses: 1/sqrt(K), times YaRN's `softmax_factor` when the context is
    stretched (`RopeScalingConfig.softmax_factor`)."""

    def __init__(
        self,
        config: ModelShape,
        rope: RotaryEmbedding,
        kernels: KernelSelection | None = None,
        track_max_logits: bool = False,
    ):
        """`track_max_logits`: keep each head's largest logit of the training forwards (`max_logits`)."""
        super().__init__()
        kernels = kernels or portable_kernels()
        mla = config.mla
        self.n_heads = config.n_heads
        self.nope_dim, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.latent_dim = mla.kv_lora_rank
        q_width = config.n_heads * mla.qk_head_dim
        self.compressed_queries = bool(mla.q_lora_rank)
        if self.compressed_queries:
            self.wq_a = Linear(config.dim, mla.q_lora_rank, kernels)
            self.q_norm = RMSNorm(mla.q_lora_rank, mla.latent_norm_eps, kernels)
            self.wq_b = Linear(mla.q_lora_rank, q_width, kernels)
        else:
            self.wq = Linear(config.dim, q_width, kernels)
        self.wkv_a = Linear(config.dim, mla.kv_lora_rank + mla.qk_rope_head_dim, kernels)
        self.kv_norm = RMSNorm(mla.kv_lora_rank, mla.latent_norm_eps, kernels)
        self.wkv_b = Linear(mla.kv_lora_rank, config.n_heads * (mla.qk_nope_head_dim + mla.v_head_dim), kernels)
        self.wo = Linear(config.n_heads * mla.v_head_dim, config.dim, kernels)
        self.gate = build_output_gate(config, config.n_heads, mla.v_head_dim, kernels)
        self.scale = config.rope_scaling.softmax_factor / math.sqrt(mla.qk_head_dim)
        self.rope = rope
        self._attention = kernels["attention"]
        self._masked_attention = kernels["attention.masked"]
        self.max_logits = MaxLogits() if track_max_logits else None
        self.sequence_split: SequenceSplit | None = None  # context parallelism: this rank's positions only

    def forward(
        self, x_BSD: torch.Tensor, cache: LayerCache | None = None, visible_BSS: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Causal attention over `x_BSD`, or over the keys `visible_BSS` allows (documents of a packed
        sequence); with a cache, over the cached latents too, at the cache's positions. Under a sequence split,
        `x_BSD` holds this rank's positions and the latents of the whole sequence are gathered (a key's latent and
        its rotary part are a few hundred numbers where its expansion is every head's key and value), then expanded
        here."""
        batch, seq_len, _ = x_BSD.shape
        split = self.sequence_split if cache is None else None
        if cache is not None:
            positions_BS = cache.step.positions_BS
        else:
            positions_BS = None if split is None else split.positions(seq_len, x_BSD.device)[None]
        q_BHSK = self._queries(x_BSD).view(batch, seq_len, self.n_heads, -1).transpose(1, 2)
        q_nope_BHSN, q_rope_BHSR = q_BHSK.split([self.nope_dim, self.rope_dim], dim=-1)
        q_BHSK = torch.cat([q_nope_BHSN, self.rope(q_rope_BHSR, positions_BS)], dim=-1)
        latent_BSL, k_rope_BSR = self.wkv_a(x_BSD).split([self.latent_dim, self.rope_dim], dim=-1)
        latent_BTL = self.kv_norm(latent_BSL)
        k_rope_BTR = self.rope(k_rope_BSR[:, None], positions_BS)[:, 0]
        if cache is not None:
            latent_BTL, k_rope_BTR = cache.extend(latent_BTL, k_rope_BTR)
            if self._absorbs(cache.latent_decoding, seq_len, latent_BTL.shape[1]):
                out_BHSE = self._absorbed(q_BHSK, latent_BTL, k_rope_BTR, cache.step.visible_BST)
                return self._output(x_BSD, out_BHSE)
        if split is not None:
            keys_BTZ = split.exchange.gather(torch.cat([latent_BTL, k_rope_BTR], dim=-1), dim=1)
            latent_BTL, k_rope_BTR = keys_BTZ.split([self.latent_dim, self.rope_dim], dim=-1)
        k_BHTK, v_BHTE = self._expand(latent_BTL, k_rope_BTR)
        if cache is None and self.max_logits is not None and torch.is_grad_enabled():
            self.max_logits.observe(q_BHSK, k_BHTK, self.scale, visible_BSS)
        if cache is not None:
            out_BHSE = self._masked_attention(q_BHSK, k_BHTK, v_BHTE, cache.step.visible_BST, scale=self.scale)
        elif visible_BSS is not None:
            out_BHSE = self._masked_attention(q_BHSK, k_BHTK, v_BHTE, visible_BSS, scale=self.scale)
        else:
            out_BHSE = self._attention(q_BHSK, k_BHTK, v_BHTE, scale=self.scale)
        return self._output(x_BSD, out_BHSE)

    def _output(self, x_BSD: torch.Tensor, out_BHSE: torch.Tensor) -> torch.Tensor:
        batch, _, seq_len, _ = out_BHSE.shape
        out_BSHE = out_BHSE.transpose(1, 2)
        if self.gate is not None:
            out_BSHE = self.gate(x_BSD, out_BSHE)
        return self.wo(out_BSHE.reshape(batch, seq_len, -1))

    def _absorbs(self, decoding: str, new: int, cached: int) -> bool:
        """Whether S = `new` queries over T = `cached` latents take the absorbed form: asked for, or (`auto`)
        fewer multiply-adds than expanding the T latents into every head's keys and values."""
        if decoding != "auto":
            return decoding == "absorbed"
        heads, latent, nope, rope, values = self.n_heads, self.latent_dim, self.nope_dim, self.rope_dim, self.v_dim
        expanded = cached * latent * heads * (nope + values) + heads * new * cached * (nope + rope + values)
        absorbed = heads * new * (nope * latent + cached * (2 * latent + rope) + latent * values)
        return absorbed < expanded

    def _absorbed(
        self, q_BHSK: torch.Tensor, latent_BTL: torch.Tensor, k_rope_BTR: torch.Tensor, visible_BST: torch.Tensor
    ) -> torch.Tensor:
        """Attention over the latents themselves: each head's position-free query taken into the latent space by
        its key up-projection, and the attended latent out through its value up-projection. Per new token and
        head, the work grows with T x (L + R), not with expanding T latents into H x (N + E). The H heads of the
        S queries attend as H x S queries of one shared key head (latent and rotary key), so no key is copied
        per head."""
        batch, heads, new, _ = q_BHSK.shape
        tokens = latent_BTL.shape[1]
        kv_HZL = self.wkv_b.weight.to(latent_BTL.dtype).view(heads, self.nope_dim + self.v_dim, self.latent_dim)
        up_keys_HNL, up_values_HEL = kv_HZL.split([self.nope_dim, self.v_dim], dim=1)
        q_nope_BHSN, q_rope_BHSR = q_BHSK.split([self.nope_dim, self.rope_dim], dim=-1)
        q_latent_BHSL = torch.einsum("bhsn,hnl->bhsl", q_nope_BHSN, up_keys_HNL)
        q_B1QZ = torch.cat([q_latent_BHSL, q_rope_BHSR], dim=-1).reshape(batch, 1, heads * new, -1)
        k_B1TZ = torch.cat([latent_BTL, k_rope_BTR], dim=-1)[:, None]
        visible_BQT = visible_BST[:, None].expand(batch, heads, new, tokens).reshape(batch, heads * new, tokens)
        out_B1QL = self._masked_attention(q_B1QZ, k_B1TZ, latent_BTL[:, None], visible_BQT, scale=self.scale)
        return torch.einsum("bhsl,hel->bhse", out_B1QL.view(batch, heads, new, self.latent_dim), up_values_HEL)

    @torch.no_grad()
    def clip_logits(self, gamma_H: torch.Tensor) -> None:
        """Scale head h's logits by `gamma_H[h]` (at most 1; QK-clip, as Kimi K2 does for MLA): its position-free
        query and key parts (the key's from the latent's up-projection) by the square root each, its rotary query
        part by the whole; the rotary key, shared by every head, is left alone."""
        root_H = gamma_H.sqrt()
        queries = (self.wq_b if self.compressed_queries else self.wq).weight
        q_HKD = queries.view(self.n_heads, self.nope_dim + self.rope_dim, -1)
        q_HKD[:, : self.nope_dim].mul_(root_H.to(queries.dtype)[:, None, None])
        q_HKD[:, self.nope_dim :].mul_(gamma_H.to(queries.dtype)[:, None, None])
        kv_HZL = self.wkv_b.weight.view(self.n_heads, self.nope_dim + self.v_dim, -1)
        kv_HZL[:, : self.nope_dim].mul_(root_H.to(kv_HZL.dtype)[:, None, None])

    def _queries(self, x_BSD: torch.Tensor) -> torch.Tensor:
        if self.compressed_queries:
            return self.wq_b(self.q_norm(self.wq_a(x_BSD)))
        return self.wq(x_BSD)

    def _expand(self, latent_BTL: torch.Tensor, k_rope_BTR: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head's keys (its position-free part from the latent, the shared rotary part beside it) and
        values, from the latents of the T tokens."""
        batch, tokens, _ = latent_BTL.shape
        kv_BHTZ = self.wkv_b(latent_BTL).view(batch, tokens, self.n_heads, -1).transpose(1, 2)
        k_nope_BHTN, v_BHTE = kv_BHTZ.split([self.nope_dim, self.v_dim], dim=-1)
        k_rope_BHTR = k_rope_BTR[:, None].expand(batch, self.n_heads, tokens, self.rope_dim)
        return torch.cat([k_nope_BHTN, k_rope_BHTR], dim=-1), v_BHTE
