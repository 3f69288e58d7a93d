"""Qwen3-MoE (`Qwen3MoeForCausalLM`): grouped-query attention with a query/key norm per head, softmax routing, dense
first layers (`mlp_only_layers`) and a head width of its own."""

from __future__ import annotations

from typing import Any, ClassVar

from ferry.interop.architectures.softmax_moe import SoftmaxMoe, softmax_moe_fields, softmax_moe_refusals
from ferry.model import ModelConfig


class Qwen3Moe(SoftmaxMoe):
    name: ClassVar[str] = "qwen3_moe"

    def natural(self, config: ModelConfig) -> bool:
        """Where its per-head norm, its dense layers or its own head width are needed."""
        own_width = config.head_dim * config.n_heads != config.dim
        return config.attention_kind.name == self.attention and (
            config.qk_norm_scope == "head" or bool(config.dense_layers) or own_width
        )

    def refusals(self, config: ModelConfig, expert_bias_nonzero: bool) -> list[str]:
        return softmax_moe_refusals(config, expert_bias_nonzero, self.name, "head")

    def hf_config(self, config: ModelConfig, common: dict[str, Any]) -> Any:
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            intermediate_size=config.dense_ffn_dim,
            moe_intermediate_size=config.moe.expert_ffn_dim,
            mlp_only_layers=list(range(config.dense_layers)),
            decoder_sparse_step=1,
            use_sliding_window=False,
            **common,
        )

    def model_fields(self, hf: Any, problems: list[str]) -> dict[str, Any]:
        """Its dense layers must be the first ones, as ferry's are."""
        dense = sorted(hf.mlp_only_layers or [])
        sparse = [i for i in range(hf.num_hidden_layers) if i not in dense and (i + 1) % hf.decoder_sparse_step == 0]
        dense_layers = hf.num_hidden_layers - len(sparse)
        if sparse != list(range(dense_layers, hf.num_hidden_layers)):
            problems.append("mlp_only_layers / decoder_sparse_step: ferry's dense layers are the first ones only")
        if getattr(hf, "use_sliding_window", False):
            problems.append("use_sliding_window: ferry's attention is full causal attention")
        return softmax_moe_fields(hf, "head", dense_layers, hf.intermediate_size, hf.moe_intermediate_size)
