"""Model configuration: the transformer and its mixture-of-experts feed-forward layers."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_serializer, model_validator

from ferry.config.section import Section
from ferry.model.rope_config import RopeScalingConfig
from ferry.model.variants import ATTENTION_KINDS, SKIP_KINDS, AttentionKind, SkipKind


class BiasBalancingConfig(Section):
    """Aux-loss-free balancing: a per-expert bias steers expert choice only, nudged toward even load."""

    enabled: bool = False
    update_rate: float = Field(1e-3, gt=0.0, description="bias step per optimizer step (sign of the load error)")


class MoEConfig(Section):
    """Router and experts of every MoE layer."""

    num_experts: int = Field(8, ge=1)
    top_k: int = Field(2, ge=1)
    expert_ffn_dim: int = Field(256, ge=1, description="hidden width of each SwiGLU expert")
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    renormalize: bool = Field(False, description="rescale the top-k weights of a token to sum to one")
    aux_loss_coef: float = Field(0.01, ge=0.0, description="switch-style load-balancing loss weight")
    z_loss_coef: float = Field(0.001, ge=0.0, description="router z-loss weight")
    bias_balancing: BiasBalancingConfig = BiasBalancingConfig()
    shared_expert_ffn_dim: int = Field(
        0, ge=0, description="width of an always-on shared expert; 0 = none (n shared experts of width F: n * F)"
    )
    n_group: int = Field(1, ge=1, description="group-limited routing: the experts split into this many groups")
    topk_group: int = Field(1, ge=1, description="a token chooses its experts within this many best groups")
    group_score: Literal["top2_sum", "max"] = Field(
        "top2_sum",
        description="what ranks a group: the sum of its two best experts' scores (DeepSeek-V3) or its best (V2)",
    )
    max_nodes: int | None = Field(
        None,
        ge=1,
        description="node-limited routing (DeepSeek-V3's rule): a token's experts lie on at most this many nodes; the "
        "n_group groups are the nodes' (group g's experts on node g of the expert-parallel ranks, which the job's "
        "layout is refused without), so this is topk_group under the name the rule goes by (DeepSeek-V3: n_group 8, "
        "max_nodes 4, top_k 8: a node ranked by its top_k / max_nodes = 2 best experts, top2_sum)",
    )
    routed_scaling_factor: float = Field(1.0, gt=0.0, description="the routed experts' weights multiplied by this")
    router_bias: bool = Field(
        False, description="a learned bias on the router's logits, for choice and weights (GPT-OSS)"
    )
    expert_biases: bool = Field(False, description="learned biases on every expert's gate, up and down projections")
    activation: Literal["swiglu", "clamped_swiglu"] = Field(
        "swiglu",
        description="swiglu: silu(gate) * up; clamped_swiglu (GPT-OSS): gate clamped above and up on both sides at "
        "swiglu_limit, then gate * sigmoid(swiglu_alpha * gate) * (up + 1)",
    )
    swiglu_alpha: float = Field(1.702, gt=0.0, description="clamped_swiglu: the sigmoid's gain")
    swiglu_limit: float = Field(7.0, gt=0.0, description="clamped_swiglu: where gate and up are clamped")

    @field_validator("top_k")
    @classmethod
    def _top_k_fits(cls, top_k: int, info: ValidationInfo) -> int:
        num_experts = info.data.get("num_experts")
        if num_experts is not None and top_k > num_experts:
            raise ValueError(f"top_k must not exceed num_experts ({num_experts})")
        return top_k

    @model_validator(mode="before")
    @classmethod
    def _max_nodes_is_topk_group(cls, data: object) -> object:
        """`max_nodes` sets `topk_group` (the groups being the nodes); given both, they must agree."""
        if not isinstance(data, dict) or data.get("max_nodes") is None:
            return data
        given = data.get("topk_group")
        if given is not None and given != data["max_nodes"]:
            raise ValueError(
                f"max_nodes {data['max_nodes']} and topk_group {given}: max_nodes is topk_group when the groups are "
                "the nodes; give one of them"
            )
        return {**data, "topk_group": data["max_nodes"]}

    @model_validator(mode="after")
    def _groups_fit(self) -> MoEConfig:
        """DeepSeek-V3's group-limited routing: every group the same size, and enough experts in the chosen
        groups for top_k."""
        if self.num_experts % self.n_group:
            raise ValueError(f"n_group {self.n_group} must divide num_experts ({self.num_experts})")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group {self.topk_group} must not exceed n_group ({self.n_group})")
        if self.max_nodes is not None and self.n_group == 1:
            raise ValueError(
                "max_nodes limits the nodes a token's experts lie on, the n_group groups being the nodes': set n_group "
                "to the nodes the experts are spread over"
            )
        per_group = self.num_experts // self.n_group
        if self.top_k > self.topk_group * per_group:
            raise ValueError(
                f"top_k {self.top_k} exceeds the {self.topk_group * per_group} experts of topk_group "
                f"{self.topk_group} groups of {per_group}"
            )
        return self


class MLAConfig(Section):
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values come from one shared latent per token,
    which is all a decoding cache keeps, with a small decoupled rotary key shared by every head."""

    q_lora_rank: int = Field(0, ge=0, description="queries through a low-rank latent this wide; 0 = a full projection")
    kv_lora_rank: int = Field(64, ge=1, description="width of the key/value latent (what the cache keeps per token)")
    qk_nope_head_dim: int = Field(32, ge=1, description="per head: the query/key part without position")
    qk_rope_head_dim: int = Field(16, ge=2, description="per head: the rotary query/key part (the key's is shared)")
    v_head_dim: int = Field(32, ge=1, description="per head: the value width")
    latent_norm_eps: float = Field(1e-6, gt=0.0, description="eps of the latents' RMSNorms (DeepSeek's: 1e-6)")

    @field_validator("qk_rope_head_dim")
    @classmethod
    def _rope_dim_even(cls, qk_rope_head_dim: int) -> int:
        if qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim {qk_rope_head_dim} must be even for RoPE")
        return qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class MTPConfig(Section):
    """Multi-token prediction (DeepSeek-V3): `depth` sequential modules after the model, module k predicting the
    token k + 1 places past the next from the previous module's hidden state and the embedding of the token k places
    ahead, through its own projection and block, with the model's embedding and head."""

    depth: int = Field(0, ge=0, description="modules; 0 = none")
    loss_weight: float = Field(
        0.3, gt=0.0, description="the MTP losses' weight: the objective adds loss_weight / depth x their sum"
    )


class ModelConfig(Section):
    """A decoder-only transformer whose feed-forward layers are MoE after the first `dense_layers`."""

    vocab_size: int = Field(4096, ge=2, description="must cover the tokenizer's vocabulary")
    dim: int = Field(256, ge=1)
    n_layers: int = Field(4, ge=1)
    attention: Literal["gqa", "mla"] = Field(
        "gqa", description="gqa: grouped-query attention; mla: multi-head latent attention (the `mla` section)"
    )
    head_dim: int | None = Field(
        None, ge=2, description="gqa: the width of a head; unset = dim // n_heads (Qwen3's, GPT-OSS's are their own)"
    )
    n_heads: int = Field(4, ge=1)
    n_kv_heads: int = Field(4, ge=1, description="grouped-query attention: heads sharing one key/value head")
    max_seq_len: int = Field(1024, ge=1)
    rope_theta: float = Field(10000.0, gt=0.0)
    rope_scaling: RopeScalingConfig = RopeScalingConfig()
    norm_eps: float = Field(1e-5, gt=0.0)
    qk_norm: bool = Field(False, description="RMSNorm on queries and keys")
    qk_norm_scope: Literal["projection", "head"] = Field(
        "projection",
        description="projection: one norm over all heads' queries (keys) together, as OLMoE; head: per head, as "
        "Qwen3-MoE",
    )
    dense_layers: int = Field(0, ge=0, description="the first N layers use a dense SwiGLU instead of MoE")
    dense_ffn_dim: int = Field(1024, ge=1)
    tie_embeddings: bool = False
    skip: Literal["standard", "farskip"] = Field(
        "standard",
        description="standard: each block reads the whole residual stream; farskip: a block's attention reads it "
        "before the previous block's FFN output has joined, so an expert-parallel combine overlaps the next "
        "attention (ferry/model/farskip.py). A different model: transformers has no such one",
    )
    init_std: float = Field(0.02, gt=0.0)
    mla: MLAConfig = MLAConfig()
    attention_bias: bool = Field(False, description="gqa: biases on the query, key, value and output projections")
    attention_sinks: bool = Field(
        False, description="gqa: a learned logit per head that joins every row's softmax and takes no value (GPT-OSS)"
    )
    sliding_window: int = Field(
        0,
        ge=0,
        description="gqa: windowed layers attend to the last this-many positions (themselves included); 0 = none",
    )
    sliding_window_pattern: int = Field(
        2,
        ge=1,
        description="with sliding_window: of every N layers the first N - 1 are windowed and the last attends to "
        "every earlier position (GPT-OSS: 2, from layer 0); 1 = every layer windowed",
    )
    attention_gate: Literal["none", "head", "elementwise"] = Field(
        "none", description="a sigmoid gate on the attention output, from the attention input: per head or per element"
    )
    moe: MoEConfig = MoEConfig()
    mtp: MTPConfig = MTPConfig()

    @field_validator("n_heads", "n_kv_heads")
    @classmethod
    def _heads_fit(cls, value: int, info: ValidationInfo) -> int:
        """The attention kind's rules for its heads, named by the field (the fields before it in `info.data`)."""
        kind = ATTENTION_KINDS.get(info.data.get("attention"))
        if kind is not None:
            kind.check_field(info.field_name, value, info.data)
        return value

    @field_validator("dense_layers")
    @classmethod
    def _dense_layers_fit(cls, dense_layers: int, info: ValidationInfo) -> int:
        n_layers = info.data.get("n_layers")
        if n_layers is not None and dense_layers > n_layers:
            raise ValueError(f"dense_layers must not exceed n_layers ({n_layers})")
        return dense_layers

    @model_validator(mode="before")
    @classmethod
    def _kind_defaults(cls, data):
        """The defaults the attention kind implies (MLA: as many key/value heads as query heads)."""
        if not isinstance(data, dict):
            return data
        kind = ATTENTION_KINDS.get(data.get("attention", cls.model_fields["attention"].default))
        return kind.with_defaults(data, cls.model_fields) if kind is not None else data

    @model_validator(mode="after")
    def _attention_fields_agree(self) -> ModelConfig:
        """The attention kind checks its fields; an unset `head_dim` then takes the kind's width, so that
        `head_dim` always says how wide a head is (GQA: `dim // n_heads`; MLA: its query/key width), while a dump
        leaves it out unless set otherwise (`_unset_head_dim_left_out`)."""
        kind = self.attention_kind
        kind.check(self)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", kind.default_head_dim(self))  # frozen: set once, here, while validated
        return self

    @model_serializer(mode="wrap")
    def _unset_head_dim_left_out(self, handler):
        """Configs, run records and checkpoint manifests read as before the field existed: a head width that is
        the kind's own is not written."""
        data = handler(self)
        if isinstance(data, dict) and self.head_dim == self.attention_kind.default_head_dim(self):
            data.pop("head_dim", None)
        return data

    @property
    def attention_kind(self) -> AttentionKind:
        return ATTENTION_KINDS[self.attention]

    @property
    def skip_kind(self) -> SkipKind:
        return SKIP_KINDS[self.skip]

    @property
    def moe_layer_count(self) -> int:
        """The MoE layers of the model and of its MTP modules (each module's block is MoE when the model's last
        block is), in the order of the step's per-layer statistics."""
        main = self.n_layers - self.dense_layers
        return main + (self.mtp.depth if main else 0)

    def attention_window(self, layer: int) -> int:
        """How many positions back layer `layer` attends, itself included: 0 for every earlier one."""
        if not self.sliding_window:
            return 0
        pattern = self.sliding_window_pattern
        return self.sliding_window if pattern == 1 or (layer + 1) % pattern else 0

    @property
    def rope_dim(self) -> int:
        """The width RoPE rotates: a whole head under GQA, the decoupled rotary part under MLA."""
        return self.attention_kind.rope_dim(self)
