"""Model configuration: the transformer and its mixture-of-experts feed-forward layers."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from ferry.config.section import Section


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
    shared_expert_ffn_dim: int = Field(0, ge=0, description="width of an always-on shared expert; 0 = none")

    @field_validator("top_k")
    @classmethod
    def _top_k_fits(cls, top_k: int, info: ValidationInfo) -> int:
        num_experts = info.data.get("num_experts")
        if num_experts is not None and top_k > num_experts:
            raise ValueError(f"top_k must not exceed num_experts ({num_experts})")
        return top_k


class RopeScalingConfig(Section):
    """How RoPE reaches past the length a model was trained at (a long-context stage sets it).

    `linear` is position interpolation (Chen et al. 2023, arXiv:2306.15595): every frequency
    divided by `factor`. `yarn` (Peng et al. 2023, arXiv:2309.00071) interpolates only the
    frequencies that turn less than `beta_slow` times over `original_max_seq_len`, keeps
    those that turn more than `beta_fast` times, ramps between, and scales the attention
    logits by 0.1 ln(factor) + 1 (through cos and sin). The base-frequency change of ABF
    (Xiong et al. 2023, arXiv:2309.16039) is `rope_theta` itself.
    """

    kind: Literal["none", "linear", "yarn"] = "none"
    factor: float = Field(1.0, ge=1.0, description="how many times longer than original_max_seq_len")
    original_max_seq_len: int | None = Field(None, ge=1, description="yarn: the length the model was trained at")
    beta_fast: float = Field(32.0, gt=0.0)
    beta_slow: float = Field(1.0, gt=0.0)

    @model_validator(mode="after")
    def _yarn_knows_its_origin(self) -> "RopeScalingConfig":
        if self.kind == "yarn" and self.original_max_seq_len is None:
            raise ValueError("yarn needs original_max_seq_len (the length the model was trained at)")
        return self


class ModelConfig(Section):
    """A decoder-only transformer whose feed-forward layers are MoE after the first `dense_layers`."""

    vocab_size: int = Field(4096, ge=2, description="must cover the tokenizer's vocabulary")
    dim: int = Field(256, ge=1)
    n_layers: int = Field(4, ge=1)
    n_heads: int = Field(4, ge=1)
    n_kv_heads: int = Field(4, ge=1, description="grouped-query attention: heads sharing one key/value head")
    max_seq_len: int = Field(1024, ge=1)
    rope_theta: float = Field(10000.0, gt=0.0)
    rope_scaling: RopeScalingConfig = RopeScalingConfig()
    norm_eps: float = Field(1e-5, gt=0.0)
    qk_norm: bool = Field(False, description="RMSNorm on queries and keys")
    qk_norm_scope: Literal["projection", "head"] = Field(
        "projection",
        description="projection: one norm over all heads' queries (keys) together, as OLMoE; head: per head, as Qwen3-MoE",
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
    moe: MoEConfig = MoEConfig()

    @field_validator("n_heads")
    @classmethod
    def _heads_divide_dim(cls, n_heads: int, info: ValidationInfo) -> int:
        dim = info.data.get("dim")
        if dim is not None and dim % n_heads:
            raise ValueError(f"n_heads must divide dim ({dim})")
        if dim is not None and (dim // n_heads) % 2:
            raise ValueError(f"head dimension dim/n_heads = {dim // n_heads} must be even for RoPE")
        return n_heads

    @field_validator("n_kv_heads")
    @classmethod
    def _kv_heads_divide_heads(cls, n_kv_heads: int, info: ValidationInfo) -> int:
        n_heads = info.data.get("n_heads")
        if n_heads is not None and n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads must divide n_heads ({n_heads})")
        return n_kv_heads

    @field_validator("dense_layers")
    @classmethod
    def _dense_layers_fit(cls, dense_layers: int, info: ValidationInfo) -> int:
        n_layers = info.data.get("n_layers")
        if n_layers is not None and dense_layers > n_layers:
            raise ValueError(f"dense_layers must not exceed n_layers ({n_layers})")
        return dense_layers

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads
