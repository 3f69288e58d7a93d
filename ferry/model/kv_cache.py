"""Static key/value buffers for incremental decoding: a prompt runs once, then one token per step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferry.model.config import ModelConfig


@dataclass(frozen=True)
class CacheStep:
    """Where the `S` tokens of one forward go: their slots, RoPE positions and the keys each may see."""

    start: int
    stop: int
    positions_BS: torch.Tensor
    visible_BST: torch.Tensor


@dataclass(frozen=True)
class LayerCache:
    """One attention layer's buffers and the step being written into them."""

    k_BGTC: torch.Tensor
    v_BGTC: torch.Tensor
    step: CacheStep

    def extend(self, k_BGSC: torch.Tensor, v_BGSC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's keys and values into their slots; every key and value up to them."""
        self.k_BGTC[:, :, self.step.start : self.step.stop] = k_BGSC
        self.v_BGTC[:, :, self.step.start : self.step.stop] = v_BGSC
        return self.k_BGTC[:, :, : self.step.stop], self.v_BGTC[:, :, : self.step.stop]


class KVCache:
    """Keys and values of every layer for a batch of left-padded rows, in buffers allocated once.

    Row b's tokens start at slot `pad_B[b]`, so the newest token of every row sits in
    the same slot and one decoding step appends one column for the whole batch. No
    query sees the padding slots of its row, and RoPE positions count from the row's
    first token, so a padded row computes what it would alone. A padding slot's query
    sees only itself, which keeps its (unused) output finite.
    """

    def __init__(
        self, config: ModelConfig, pad_B: torch.Tensor, capacity: int, dtype: torch.dtype, device: torch.device
    ):
        if capacity > config.max_seq_len:
            raise ValueError(f"a cache of {capacity} slots exceeds model.max_seq_len ({config.max_seq_len})")
        shape = (config.n_layers, pad_B.shape[0], config.n_kv_heads, capacity, config.head_dim)
        self.k_LBGTC = torch.zeros(shape, dtype=dtype, device=device)
        self.v_LBGTC = torch.zeros(shape, dtype=dtype, device=device)
        self.pad_B = pad_B.to(device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k_LBGTC.shape[3]

    def begin(self, new: int) -> CacheStep:
        """The step that appends `new` tokens to every row after the filled slots."""
        if self.length + new > self.capacity:
            raise ValueError(f"{new} more tokens overflow the cache ({self.length} of {self.capacity} slots filled)")
        device = self.pad_B.device
        slots_S = torch.arange(self.length, self.length + new, device=device)
        keys_T = torch.arange(self.length + new, device=device)
        positions_BS = (slots_S[None, :] - self.pad_B[:, None]).clamp(min=0)
        causal_1ST = keys_T[None, None, :] <= slots_S[None, :, None]
        in_row_B1T = keys_T[None, None, :] >= self.pad_B[:, None, None]
        itself_1ST = keys_T[None, None, :] == slots_S[None, :, None]
        visible_BST = (causal_1ST & in_row_B1T) | itself_1ST
        return CacheStep(self.length, self.length + new, positions_BS, visible_BST)

    def layer(self, index: int, step: CacheStep) -> LayerCache:
        return LayerCache(self.k_LBGTC[index], self.v_LBGTC[index], step)

    def commit(self, step: CacheStep) -> None:
        self.length = step.stop
