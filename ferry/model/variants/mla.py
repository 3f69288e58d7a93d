"""`model.attention: mla`: DeepSeek-V2/V3's multi-head latent attention (`ferry/model/latent_attention.py`),
settings in `model.mla`: keys and values expanded from one small latent per token, which is all the cache keeps.

Letters as in `latent_attention.py`: L the latent, R the rotary part, N the position-free part, K = N + R, E the
value width, H heads.
"""

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
class MultiHeadLatentAttention:
    """Every head its own keys and values, from the shared latent; a rotary key slice shared by every head."""

    name: ClassVar[str] = "mla"
    hf_layer_names: ClassVar[dict[str, str]] = {
        "attn.wq.weight": "self_attn.q_proj.weight",
        "attn.wq_a.weight": "self_attn.q_a_proj.weight",
        "attn.q_norm.weight": "self_attn.q_a_layernorm.weight",
        "attn.wq_b.weight": "self_attn.q_b_proj.weight",
        "attn.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attn.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attn.wkv_b.weight": "self_attn.kv_b_proj.weight",
        "attn.wo.weight": "self_attn.o_proj.weight",
    }

    def with_defaults(self, data: dict, fields: dict[str, FieldInfo]) -> dict:
        """n_kv_heads is n_heads unless said otherwise (and saying otherwise is refused), so that a dumped config
        reads back."""
        if "n_kv_heads" in data:
            return data
        return {**data, "n_kv_heads": data.get("n_heads", fields["n_heads"].default)}

    def check_field(self, field: str, value: int, data: dict[str, Any]) -> None:
        """MLA's head widths are its own (the mla section); its key/value heads are checked with the rest."""

    def check(self, config: ModelShape) -> None:
        if config.head_dim is not None:
            raise ValueError("head_dim: MLA's head widths are its own (the mla section); leave head_dim unset")
        if config.qk_norm:
            raise ValueError("qk_norm: MLA normalises its latents instead (mla.latent_norm_eps); leave it false")
        for field in ("attention_bias", "attention_sinks", "sliding_window"):
            if getattr(config, field):
                raise ValueError(f"{field}: grouped-query attention's (gqa); MLA has no such part")
        if config.n_kv_heads != config.n_heads:
            raise ValueError(
                f"n_kv_heads {config.n_kv_heads}: MLA gives every head its own keys and values (from the shared "
                f"latent); leave n_kv_heads unset or {config.n_heads}"
            )

    def default_head_dim(self, config: ModelShape) -> int:
        """The position-free part and the rotary part together."""
        return config.mla.qk_head_dim

    def rope_dim(self, config: ModelShape) -> int:
        """The decoupled rotary part only."""
        return config.mla.qk_rope_head_dim

    def module(
        self,
        config: ModelShape,
        rope: RotaryEmbedding,
        kernels: KernelSelection,
        track_max_logits: bool = False,
        window: int = 0,
    ) -> nn.Module:
        from ferry.model.latent_attention import LatentAttention  # the module reads the config, which asks this kind

        return LatentAttention(config, rope, kernels, track_max_logits)  # `check` refuses a window

    def parameters(self, config: ModelShape) -> int:
        """The key/value expansion is a matmul parameter like any other: in training each token's latent is
        expanded once."""
        dim, heads, mla = config.dim, config.n_heads, config.mla
        if mla.q_lora_rank:
            queries = dim * mla.q_lora_rank + mla.q_lora_rank + mla.q_lora_rank * heads * mla.qk_head_dim
        else:
            queries = dim * heads * mla.qk_head_dim
        latent = dim * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank
        expansion = mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        return queries + latent + expansion + heads * mla.v_head_dim * dim

    def head_widths(self, config: ModelShape) -> tuple[int, int]:
        return config.mla.qk_head_dim, config.mla.v_head_dim

    def kept_values(self, config: ModelShape, mode: Recompute) -> int:
        """none: the latent projection (L + R) and the normalised latent (L), the query latent and its norm (with
        `q_lora_rank`), every head's queries and keys (K each), its values and output (padded to the query/key
        width, the attention op's one head width) and the output narrowed back to E for the output projection.
        selective: the outputs of the query GEMMs, of the latent projection and expansion (N + E a head), the
        attention's and the output projection's. full: nothing.

        Not GQA's: every head's keys and values are expanded, and kept, where the cache keeps one latent."""
        mla, heads = config.mla, config.n_heads
        latent, rope, key, value = mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_head_dim, mla.v_head_dim
        padded = max(key, value)
        if mode == "none":
            per_head = 2 * key + 2 * padded + value
            return (latent + rope) + latent + 2 * mla.q_lora_rank + heads * per_head
        if mode == "selective":
            queries = mla.q_lora_rank + heads * key
            expansion = heads * (mla.qk_nope_head_dim + value)
            return queries + (latent + rope) + expansion + heads * padded + config.dim
        return 0

    def gathered_values(self, config: ModelShape, mode: Recompute) -> int:
        """The gathered latent and rotary key (every mode), and without full recompute every head's key and value
        expanded from them (padded to the key width, as the attention op takes them)."""
        mla, heads = config.mla, config.n_heads
        gathered = mla.kv_lora_rank + mla.qk_rope_head_dim
        return gathered if mode == "full" else gathered + heads * 2 * max(mla.qk_head_dim, mla.v_head_dim)

    def cache_entry_shapes(self, config: ModelShape, capacity: int) -> list[tuple[int, ...]]:
        """The normalised latent [T, L] and the rotated shared rotary key [T, R], from which every head's keys and
        values follow."""
        return [(capacity, config.mla.kv_lora_rank), (capacity, config.mla.qk_rope_head_dim)]

    def describe_cache(self, config: ModelShape) -> str:
        return f"MLA latent: {config.mla.kv_lora_rank} + {config.mla.qk_rope_head_dim} rotary values a layer"

    def hf_config_fields(self, config: ModelShape) -> dict[str, Any]:
        """DeepSeek's latent sizes (how the rotary rows are laid out is the architecture's: its kind says)."""
        mla = config.mla
        return {
            "num_key_value_heads": config.n_heads,
            "q_lora_rank": mla.q_lora_rank or None,
            "kv_lora_rank": mla.kv_lora_rank,
            "qk_nope_head_dim": mla.qk_nope_head_dim,
            "qk_rope_head_dim": mla.qk_rope_head_dim,
            "v_head_dim": mla.v_head_dim,
        }

    def fields_from_hf(self, hf: Any, problems: list[str]) -> dict[str, Any]:
        if hf.num_key_value_heads != hf.num_attention_heads:
            problems.append("num_key_value_heads: MLA gives every head its own keys and values")
        return {
            "attention": self.name,
            "qk_norm": False,
            "mla": {
                "q_lora_rank": hf.q_lora_rank or 0,
                "kv_lora_rank": hf.kv_lora_rank,
                "qk_nope_head_dim": hf.qk_nope_head_dim,
                "qk_rope_head_dim": hf.qk_rope_head_dim,
                "v_head_dim": hf.v_head_dim,
            },
        }
