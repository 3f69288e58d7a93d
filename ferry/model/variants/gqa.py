"""`model.attention: gqa`: grouped-query attention (`ferry/model/attention.py`), `n_heads` query heads sharing
`n_kv_heads` key/value heads, each `head_dim` wide (by default `dim // n_heads`; Qwen3's and GPT-OSS's heads are
wider or narrower than that split)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic.fields import FieldInfo
from torch import nn

if TYPE_CHECKING:
    from ferry.kernels import KernelSelection
    from ferry.model.recompute import Recompute
    from ferry.model.rope import RotaryEmbedding
    from ferry.model.variants.base import ModelShape


@dataclass(frozen=True)
class GroupedQueryAttention:
    """Queries, keys and values projected per head; the cache keeps every layer's keys and values."""

    name: ClassVar[str] = "gqa"
    hf_layer_names: ClassVar[dict[str, str]] = {
        "attn.wq.weight": "self_attn.q_proj.weight",
        "attn.wk.weight": "self_attn.k_proj.weight",
        "attn.wv.weight": "self_attn.v_proj.weight",
        "attn.wo.weight": "self_attn.o_proj.weight",
        "attn.q_norm.weight": "self_attn.q_norm.weight",
        "attn.k_norm.weight": "self_attn.k_norm.weight",
    }

    def with_defaults(self, data: dict, fields: dict[str, FieldInfo]) -> dict:
        return data

    def check_field(self, field: str, value: int, data: dict[str, Any]) -> None:
        """`head_dim` unset splits `dim` over the heads, which must then divide it; RoPE rotates pairs; key/value
        heads are shared by equal groups of query heads."""
        dim, head_dim = data.get("dim"), data.get("head_dim")
        if field == "n_heads" and dim is not None:
            if head_dim is None and dim % value:
                raise ValueError(f"n_heads must divide dim ({dim}), or set head_dim")
            if (head_dim or dim // value) % 2:
                raise ValueError(f"head dimension {head_dim or dim // value} must be even for RoPE")
        n_heads = data.get("n_heads")
        if field == "n_kv_heads" and n_heads is not None and n_heads % value:
            raise ValueError(f"n_kv_heads must divide n_heads ({n_heads})")

    def check(self, config: ModelShape) -> None:
        if config.rope_scaling.mscale_all_dim:
            raise ValueError("rope_scaling.mscale_all_dim scales MLA's softmax (DeepSeek's YaRN); this model is gqa")

    def default_head_dim(self, config: ModelShape) -> int:
        return config.dim // config.n_heads

    def rope_dim(self, config: ModelShape) -> int:
        return config.head_dim

    def module(
        self,
        config: ModelShape,
        rope: RotaryEmbedding,
        kernels: KernelSelection,
        track_max_logits: bool = False,
        window: int = 0,
    ) -> nn.Module:
        from ferry.model.attention import Attention  # the module reads the config, which asks this kind

        return Attention(config, rope, kernels, track_max_logits, window)

    def parameters(self, config: ModelShape) -> int:
        q_width, kv_width = self._widths(config)
        params = config.dim * q_width * 2 + config.dim * kv_width * 2
        if config.qk_norm:
            params += 2 * config.head_dim if config.qk_norm_scope == "head" else q_width + kv_width
        if config.attention_bias:
            params += q_width + 2 * kv_width + config.dim
        return params + (config.n_heads if config.attention_sinks else 0)

    def head_widths(self, config: ModelShape) -> tuple[int, int]:
        return config.head_dim, config.head_dim

    def kept_values(self, config: ModelShape, mode: Recompute) -> int:
        """none: the query/key/value projection, the rotated queries and keys and the attention's output, each
        counted at the query width (keys and values are narrower with fewer key/value heads: an upper bound).
        selective: the projection, the attention's output and the output projection's. full: nothing."""
        q_width, _ = self._widths(config)
        return {"none": 6 * q_width, "selective": 4 * q_width + config.dim, "full": 0}[mode]

    def gathered_values(self, config: ModelShape, mode: Recompute) -> int:
        """The gathered keys and values, kept in every mode (a recompute reads them instead of gathering again)."""
        _, kv_width = self._widths(config)
        return 2 * kv_width

    def cache_entry_shapes(self, config: ModelShape, capacity: int) -> list[tuple[int, ...]]:
        """Keys and values, [G, T, C] each."""
        return [(config.n_kv_heads, capacity, config.head_dim)] * 2

    def describe_cache(self, config: ModelShape) -> str:
        return f"keys and values: 2 x {config.n_kv_heads} heads x {config.head_dim} a layer"

    def hf_config_fields(self, config: ModelShape) -> dict[str, Any]:
        """Key/value heads, and `head_dim` where it is not transformers' default split (so that an export of a
        model with the default writes what it always wrote)."""
        fields: dict[str, Any] = {"num_key_value_heads": config.n_kv_heads}
        if config.head_dim != self.default_head_dim(config):
            fields["head_dim"] = config.head_dim
        return fields

    def fields_from_hf(self, hf: Any, problems: list[str]) -> dict[str, Any]:
        split = hf.hidden_size // hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or split
        fields: dict[str, Any] = {"n_kv_heads": hf.num_key_value_heads}
        if head_dim * hf.num_attention_heads != hf.hidden_size:
            fields["head_dim"] = head_dim
        return fields

    def _widths(self, config: ModelShape) -> tuple[int, int]:
        """The query projection's width and the key (or value) projection's."""
        return config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
