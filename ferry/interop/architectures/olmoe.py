"""OLMoE (`OlmoeForCausalLM`): grouped-query attention with one query/key norm over the whole projection, softmax
routing, no dense layers, heads that split the hidden size."""

from __future__ import annotations

from typing import Any, ClassVar

from ferry.interop.architectures.softmax_moe import SoftmaxMoe, softmax_moe_fields, softmax_moe_refusals
from ferry.model import ModelConfig


class Olmoe(SoftmaxMoe):
    name: ClassVar[str] = "olmoe"

    def natural(self, config: ModelConfig) -> bool:
        return config.attention_kind.name == self.attention  # the grouped-query model no other takes

    def refusals(self, config: ModelConfig, expert_bias_nonzero: bool) -> list[str]:
        problems = []
        if config.head_dim * config.n_heads != config.dim:
            problems.append(
                f"model.head_dim {config.head_dim}: olmoe's heads split hidden_size ({config.dim}); qwen3_moe has a "
                "head_dim of its own"
            )
        problems += softmax_moe_refusals(config, expert_bias_nonzero, self.name, "projection")
        if config.dense_layers:
            problems.append("model.dense_layers: OLMoE has no dense layers (qwen3_moe has, as mlp_only_layers)")
        return problems

    def hf_config(self, config: ModelConfig, common: dict[str, Any]) -> Any:
        from transformers import OlmoeConfig

        return OlmoeConfig(intermediate_size=config.moe.expert_ffn_dim, clip_qkv=None, **common)

    def model_fields(self, hf: Any, problems: list[str]) -> dict[str, Any]:
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        if head_dim * hf.num_attention_heads != hf.hidden_size:
            problems.append(f"head_dim {head_dim}: OLMoE's query/key norms span hidden_size ({hf.hidden_size})")
        return softmax_moe_fields(hf, "projection", 0, ModelConfig().dense_ffn_dim, hf.intermediate_size)
