"""What an attention kind and a skip-wiring kind answer (`ferry/model/variants/`), so that no caller branches on
a variant's name.

A kind is stateless: every answer is a function of the model config it is asked about. The config is imported
for its type only, since the config itself asks its kinds to validate and resolve it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from pydantic.fields import FieldInfo
from torch import nn

if TYPE_CHECKING:
    from ferry.kernels import KernelSelection
    from ferry.model.recompute import Recompute
    from ferry.model.rope import RotaryEmbedding


class ModelShape(Protocol):
    """What the kinds and the attention modules read of a model config (`ferry.model.config.ModelConfig`, which
    asks its kinds to check and complete it, and so is not imported by them)."""

    dim: int
    n_layers: int
    dense_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_seq_len: int
    norm_eps: float
    qk_norm: bool
    qk_norm_scope: str
    attention_gate: str
    attention_bias: bool
    attention_sinks: bool
    mla: Any  # the `mla` section: latent and head widths
    rope_scaling: Any

    @property
    def attention_kind(self) -> AttentionKind: ...


class AttentionKind(Protocol):
    """One way of attending (`model.attention`)."""

    name: ClassVar[str]
    hf_layer_names: ClassVar[dict[str, str]]  # a layer's attention tensors: ferry's name -> transformers'

    def with_defaults(self, data: dict, fields: dict[str, FieldInfo]) -> dict:
        """The raw model section with the defaults this kind implies filled in, before validation (`fields`: the
        model config's, for their defaults)."""

    def check_field(self, field: str, value: int, data: dict[str, Any]) -> None:
        """Raise ValueError for a head count (`n_heads`, `n_kv_heads`) this kind cannot run, so that the error
        names that field; `data` holds the fields validated before it."""

    def check(self, config: ModelShape) -> None:
        """Raise ValueError, naming the field, for settings this kind cannot run together."""

    def default_head_dim(self, config: ModelShape) -> int:
        """The query/key width of a head when `model.head_dim` is unset (what the config's `head_dim` then holds)."""

    def rope_dim(self, config: ModelShape) -> int:
        """The width RoPE rotates."""

    def module(
        self,
        config: ModelShape,
        rope: RotaryEmbedding,
        kernels: KernelSelection,
        track_max_logits: bool = False,
        window: int = 0,
    ) -> nn.Module:
        """A block's attention module (keeping each head's largest training logit with `track_max_logits`;
        attending to the last `window` positions only, when not 0); it has `clip_logits(gamma_H)`, which scales
        each head's logits by its gamma."""

    def parameters(self, config: ModelShape) -> int:
        """One layer's attention parameters (projections and norms; the output gate is counted apart)."""

    def head_widths(self, config: ModelShape) -> tuple[int, int]:
        """A head's query/key width and value width: the widths the score and value products run at."""

    def kept_values(self, config: ModelShape, mode: Recompute) -> int:
        """Values (of the compute dtype) one token keeps for the backward in one layer's attention, by
        `train.activation_checkpointing` mode."""

    def gathered_values(self, config: ModelShape, mode: Recompute) -> int:
        """Values (of the compute dtype) a context-parallel rank keeps for the backward in one layer for each token
        of the whole sequence: what the attention gathers from the other ranks (`parallel.cp`), and what it makes
        of it for every key."""

    def cache_entry_shapes(self, config: ModelShape, capacity: int) -> list[tuple[int, ...]]:
        """The decoding cache of one layer and row: one shape per buffer, its token slot second-last."""

    def describe_cache(self, config: ModelShape) -> str:
        """What the cache keeps of a token, in the terms of this attention."""

    def hf_config_fields(self, config: ModelShape) -> dict[str, Any]:
        """The transformers config fields of this attention (those every architecture computing it has)."""

    def fields_from_hf(self, hf: Any, problems: list[str]) -> dict[str, Any]:
        """The ferry model fields of this attention a transformers config describes; what ferry cannot compute
        is added to `problems`, naming the transformers field."""


class SkipKind(Protocol):
    """One way of wiring the residual stream between blocks (`model.skip`)."""

    name: ClassVar[str]
    pipeline_refusal: ClassVar[str | None]  # why a pipeline stage cannot hand this stream over; None when it can
    # what a block hands on unfinished, which a wrapper that acts only on the tensors a block returns (FSDP's hooks
    # that gather the weights for its backward) does not see; None when a block returns all it computed
    unfinished_output: ClassVar[str | None]
    converts_from: ClassVar[dict[str, str]]  # the skip kinds a checkpoint may be continued from, and what to say

    def stream(self, x_BSD: torch.Tensor) -> Any:
        """The stream the first block reads, from the embeddings."""

    def joined(self, stream: Any) -> torch.Tensor:
        """The whole residual stream after the last block, for the final norm."""

    def export_refusals(self, config: ModelShape, arch: str) -> list[str]:
        """Why this wiring cannot be written as `arch`."""
