"""Grouped-query causal self-attention, optionally gated, windowed, with projection biases and attention sinks
(GPT-OSS's parts); the attention itself is the `attention` op, or `attention.masked` where a mask or sinks are
needed."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ferry.kernels import KernelSelection, portable_kernels
from ferry.kernels.amp import in_autocast_dtype
from ferry.model.attention_gate import build_output_gate
from ferry.model.kv_cache import LayerCache
from ferry.model.linear import Linear
from ferry.model.max_logit import MaxLogits
from ferry.model.norm import RMSNorm
from ferry.model.rope import RotaryEmbedding
from ferry.model.sequence_split import SequenceSplit

if TYPE_CHECKING:
    from ferry.model.variants.base import ModelShape


class Attention(nn.Module):
    """`n_heads` query heads share `n_kv_heads` key/value heads; RoPE on queries and keys.

    With `window`, a position attends to the last `window` positions only (itself included). With
    `model.attention_sinks`, each head has a learned logit `sinks_H[h]` that joins every row's softmax and adds
    no value: a head may give a row's weight to nothing rather than spread it over the keys (GPT-OSS).
    """

    def __init__(
        self,
        config: ModelShape,
        rope: RotaryEmbedding,
        kernels: KernelSelection | None = None,
        track_max_logits: bool = False,
        window: int = 0,
    ):
        """`track_max_logits`: keep each head's largest logit of the training forwards (`max_logits`)."""
        super().__init__()
        kernels = kernels or portable_kernels()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        q_width, kv_width = config.n_heads * self.head_dim, config.n_kv_heads * self.head_dim
        bias = config.attention_bias
        self.wq = Linear(config.dim, q_width, kernels, bias)
        self.wk = Linear(config.dim, kv_width, kernels, bias)
        self.wv = Linear(config.dim, kv_width, kernels, bias)
        self.wo = Linear(q_width, config.dim, kernels, bias)
        self.sinks_H = nn.Parameter(torch.zeros(config.n_heads)) if config.attention_sinks else None
        self.window = window
        per_head = config.qk_norm_scope == "head"
        self.q_norm = (
            RMSNorm(self.head_dim if per_head else q_width, config.norm_eps, kernels) if config.qk_norm else None
        )
        self.k_norm = (
            RMSNorm(self.head_dim if per_head else kv_width, config.norm_eps, kernels) if config.qk_norm else None
        )
        self.per_head_norm = per_head
        self.gate = build_output_gate(config, config.n_heads, self.head_dim, kernels)
        self.rope = rope
        self._linear = kernels["linear"]
        self._attention = kernels["attention"]
        self._masked_attention = kernels["attention.masked"]
        self.max_logits = MaxLogits() if track_max_logits else None
        self.sequence_split: SequenceSplit | None = None  # context parallelism: this rank's positions only

    def forward(
        self, x_BSD: torch.Tensor, cache: LayerCache | None = None, visible_BSS: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Causal attention over `x_BSD`, or over the keys `visible_BSS` allows (documents of a packed
        sequence); with a cache, over the cached keys too, at the cache's positions. Under a sequence split,
        `x_BSD` holds this rank's positions, rotated as theirs, and the keys and values are gathered whole."""
        batch, seq_len, _ = x_BSD.shape
        q_BSX, k_BSY, v_BSY = self._project_qkv(x_BSD)
        if self.q_norm is not None and not self.per_head_norm:
            q_BSX = self.q_norm(q_BSX)
            k_BSY = self.k_norm(k_BSY)
        q_BSHC = q_BSX.view(batch, seq_len, self.n_heads, self.head_dim)
        k_BSGC = k_BSY.view(batch, seq_len, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and self.per_head_norm:
            q_BSHC = self.q_norm(q_BSHC)
            k_BSGC = self.k_norm(k_BSGC)
        q_BHSC = q_BSHC.transpose(1, 2)
        k_BGSC = k_BSGC.transpose(1, 2)
        v_BGSC = v_BSY.view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if cache is None:
            split = self.sequence_split
            positions_1S = None if split is None else split.positions(seq_len, x_BSD.device)[None]
            q_BHSC, k_BGSC = self.rope(q_BHSC, positions_1S), self.rope(k_BGSC, positions_1S)
            if split is not None:
                kv_BGTZ = split.exchange.gather(torch.cat([k_BGSC, v_BGSC], dim=-1), dim=2)
                k_BGSC, v_BGSC = kv_BGTZ.split([self.head_dim, self.head_dim], dim=-1)
            visible_BSS = self._within_window(visible_BSS, seq_len, x_BSD.device)
            if self.max_logits is not None and torch.is_grad_enabled():
                self.max_logits.observe(q_BHSC, k_BGSC, self.head_dim**-0.5, visible_BSS)
        sinks = {} if self.sinks_H is None else {"sinks_H": self.sinks_H}
        if cache is not None:
            positions_BS = cache.step.positions_BS
            k_BGTC, v_BGTC = cache.extend(self.rope(k_BGSC, positions_BS), v_BGSC)
            visible_BST = self._cached_within_window(cache)
            out_BHSC = self._masked_attention(self.rope(q_BHSC, positions_BS), k_BGTC, v_BGTC, visible_BST, **sinks)
        elif visible_BSS is not None or sinks:
            causal_1SS = torch.ones(seq_len, seq_len, dtype=torch.bool, device=x_BSD.device).tril()[None]
            visible_BSS = causal_1SS if visible_BSS is None else visible_BSS
            out_BHSC = self._masked_attention(q_BHSC, k_BGSC, v_BGSC, visible_BSS, **sinks)
        else:
            out_BHSC = self._attention(q_BHSC, k_BGSC, v_BGSC)
        out_BSHC = out_BHSC.transpose(1, 2)
        if self.gate is not None:
            out_BSHC = self.gate(x_BSD, out_BSHC)
        return self.wo(out_BSHC.reshape(batch, seq_len, -1))

    @torch.no_grad()
    def clip_logits(self, gamma_H: torch.Tensor) -> None:
        """Scale head h's logits by `gamma_H[h]` (at most 1; QK-clip). Heads sharing keys scale them alike: the
        keys of a group by the square root of its smallest gamma, each query by the rest of its own, so every head
        gets exactly its gamma. Queries and keys are linear in their weights (RoPE rotates them), so scaling the
        weights' rows scales the logits."""
        groups, per_group = self.n_kv_heads, self.n_heads // self.n_kv_heads
        gamma_GP = gamma_H.view(groups, per_group).to(self.wq.weight.dtype)
        key_G = gamma_GP.amin(dim=1).sqrt()
        self.wk.weight.view(groups, self.head_dim, -1).mul_(key_G[:, None, None])
        self.wq.weight.view(self.n_heads, self.head_dim, -1).mul_((gamma_GP / key_G[:, None]).reshape(-1, 1, 1))

    def _within_window(
        self, visible_BSS: torch.Tensor | None, seq_len: int, device: torch.device
    ) -> torch.Tensor | None:
        """The keys a position of a whole sequence sees, narrowed to the window (unchanged without one)."""
        if not self.window:
            return visible_BSS
        distance_SS = torch.arange(seq_len, device=device)[:, None] - torch.arange(seq_len, device=device)[None, :]
        band_1SS = ((distance_SS >= 0) & (distance_SS < self.window))[None]
        return band_1SS if visible_BSS is None else visible_BSS & band_1SS

    def _cached_within_window(self, cache: LayerCache) -> torch.Tensor:
        """The cached keys a decoding step's queries see, narrowed to the window: a row's slots are its positions
        shifted by its padding, so slot distance is position distance."""
        step = cache.step
        if not self.window:
            return step.visible_BST
        device = step.visible_BST.device
        slots_S1 = torch.arange(step.start, step.stop, device=device)[:, None]
        within_1ST = (slots_S1 - torch.arange(step.stop, device=device)[None, :] < self.window)[None]
        return step.visible_BST & within_1ST

    def _project_qkv(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The query, key and value projections as one GEMM over the three weights side by side.

        The parameters stay three (the state-dict keys checkpoints and transformers share); one GEMM of
        three times the width runs fuller, and backward makes the input gradient in one GEMM where three
        would each write one and autograd would sum them.
        """
        w_ZD = torch.cat([self.wq.weight, self.wk.weight, self.wv.weight])
        if self.wq.bias is None:
            qkv_BSZ = self._linear(*in_autocast_dtype(x_BSD, w_ZD))
        else:
            x_BSD, w_ZD, b_Z = in_autocast_dtype(x_BSD, w_ZD, torch.cat([self.wq.bias, self.wk.bias, self.wv.bias]))
            qkv_BSZ = self._linear(x_BSD, w_ZD) + b_Z
        return qkv_BSZ.split([self.wq.out_features, self.wk.out_features, self.wv.out_features], dim=-1)
