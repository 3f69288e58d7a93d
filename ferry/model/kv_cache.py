"""Static key/value (or MLA latent) buffers for incremental decoding: a prompt runs once, then one token per step."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from ferry.model.variants.base import ModelShape


@dataclass(frozen=True)
class CacheStep:
    """Where the `S` tokens of one forward go: their slots, RoPE positions and the keys each may see."""

    start: int
    stop: int
    positions_BS: torch.Tensor
    visible_BST: torch.Tensor


LatentDecoding = Literal["auto", "absorbed", "expanded"]


@dataclass(frozen=True)
class LayerCache:
    """One attention layer's buffers and the step being written into them: its keys and values (GQA), or
    its key/value latent and shared rotary key (MLA); in each, the token's slot is the second-last dim.
    `latent_decoding`: how MLA attends over its cached latents (`LatentAttention`)."""

    buffers: tuple[torch.Tensor, ...]
    step: CacheStep
    latent_decoding: LatentDecoding = "auto"

    def extend(self, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Write the step's entries (one tensor per buffer) into their slots; every entry up to them."""
        for buffer, entries in zip(self.buffers, new, strict=True):
            buffer[..., self.step.start : self.step.stop, :] = entries
        return tuple(buffer[..., : self.step.stop, :] for buffer in self.buffers)


class KVCache:
    """Keys and values of every layer this process holds (under MLA, the latent they are expanded from; a
    pipeline stage holds its own blocks') for a batch of left-padded rows, in buffers allocated once.

    Row b's tokens start at slot `pad_B[b]`, so the newest token of every row sits in
    the same slot and one decoding step appends one column for the whole batch. No
    query sees the padding slots of its row, and RoPE positions count from the row's
    first token, so a padded row computes what it would alone. A padding slot's query
    sees only itself, which keeps its (unused) output finite.
    """

    def __init__(
        self,
        config: ModelShape,
        pad_B: torch.Tensor,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
        layers: Sequence[int] | None = None,
        latent_decoding: LatentDecoding = "auto",
    ):
        """`layers`: the indices of the blocks whose entries it keeps (default: every block). `latent_decoding`:
        under MLA, attend over the cached latents with the up-projections absorbed into the query and output
        (`absorbed`), over the keys and values expanded from them (`expanded`), or whichever takes fewer
        multiply-adds for a step's shape (`auto`: absorbed for decoding, expanded for a long prefill)."""
        if capacity > config.max_seq_len:
            raise ValueError(f"a cache of {capacity} slots exceeds model.max_seq_len ({config.max_seq_len})")
        self.config = config
        held = range(config.n_layers) if layers is None else layers
        self._slot = {index: slot for slot, index in enumerate(held)}
        self.buffers = tuple(
            torch.zeros((len(self._slot), pad_B.shape[0], *shape), dtype=dtype, device=device)
            for shape in _entry_shapes(config, capacity)
        )
        self.pad_B = pad_B.to(device)
        self.length = 0
        self.latent_decoding = latent_decoding

    @property
    def capacity(self) -> int:
        return self.buffers[0].shape[-2]

    @property
    def bytes_per_token(self) -> int:
        """What one token of one row occupies over every layer of the model (a pipeline's stages together): MLA's
        reason to exist, in numbers."""
        return cache_bytes_per_token(self.config, self.buffers[0].dtype.itemsize)

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
        if index not in self._slot:
            raise ValueError(f"block {index} is not cached here (this cache keeps blocks {sorted(self._slot)})")
        slot = self._slot[index]
        return LayerCache(tuple(buffer[slot] for buffer in self.buffers), step, self.latent_decoding)

    def commit(self, step: CacheStep) -> None:
        self.length = step.stop


def _entry_shapes(config: ModelShape, capacity: int) -> list[tuple[int, ...]]:
    """Per layer and row, the attention kind's buffers (GQA: keys and values [G, T, C]; MLA: the normalised
    latent and the rotated shared rotary key, [T, L] and [T, R])."""
    return config.attention_kind.cache_entry_shapes(config, capacity)


def cache_bytes_per_token(config: ModelShape, itemsize: int) -> int:
    """Bytes one cached token of one row takes over every layer, at `itemsize` bytes an element."""
    return config.n_layers * itemsize * sum(math.prod(shape) for shape in _entry_shapes(config, 1))
