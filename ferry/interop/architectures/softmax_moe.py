"""What OLMoE and Qwen3-MoE share: grouped-query attention with a query/key norm, routed by a softmax in fp32, then
top-k, then an optional renormalisation, exactly as ferry's router, and the same weight names. They differ in the
query/key norm (OLMoE: one norm over the whole projection; Qwen3-MoE: per head) and in dense layers (only Qwen3-MoE
has them, as `mlp_only_layers`)."""

from __future__ import annotations

from typing import ClassVar

import torch

from ferry.interop.architectures.base import ArchitectureKind
from ferry.model import ModelConfig


class SoftmaxMoe(ArchitectureKind):
    """OLMoE's and Qwen3-MoE's common ground: their attention and their weight names."""

    attention: ClassVar[str] = "gqa"
    attention_words: ClassVar[str] = "grouped-query attention"

    def to_hf_state(self, state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        return softmax_moe_to_hf_state(state, config)

    def from_hf_state(
        self, hf: dict[str, torch.Tensor], config: ModelConfig, rope_interleave: bool
    ) -> dict[str, torch.Tensor]:
        return softmax_moe_from_hf_state(hf, config)


def softmax_moe_refusals(config: ModelConfig, expert_bias_nonzero: bool, arch: str, scope: str) -> list[str]:
    """Why `config` cannot be written as `arch`, a softmax-routed GQA MoE whose query/key norm is per `scope`."""
    moe, problems = config.moe, []
    if config.attention_gate != "none":
        problems.append(f"model.attention_gate {config.attention_gate!r}: {arch} has no attention output gate")
    if moe.n_group > 1 or moe.routed_scaling_factor != 1.0:
        problems.append(f"model.moe.n_group / routed_scaling_factor: {arch} routes without groups or scaling")
    if moe.score_func != "softmax":
        problems.append(f"model.moe.score_func: {arch} routes with a softmax, the model uses {moe.score_func}")
    if moe.shared_expert_ffn_dim:
        problems.append(f"model.moe.shared_expert_ffn_dim: {arch} has no shared expert")
    if expert_bias_nonzero:
        problems.append(
            f"model.moe.bias_balancing: {arch} has no expert-choice bias, and this model's bias is not zero"
        )
    if not config.qk_norm:
        problems.append(f"model.qk_norm: {arch} always normalises queries and keys; the model does not")
    if config.qk_norm and config.qk_norm_scope != scope:
        problems.append(f"model.qk_norm_scope: {arch} normalises per {scope}, the model per {config.qk_norm_scope}")
    return problems


def softmax_moe_fields(hf, scope: str, dense_layers: int, dense_ffn_dim: int, expert_ffn_dim: int) -> dict:
    return dict(
        qk_norm=True,
        qk_norm_scope=scope,
        dense_layers=dense_layers,
        dense_ffn_dim=dense_ffn_dim,
        moe={
            "num_experts": hf.num_experts,
            "top_k": hf.num_experts_per_tok,
            "expert_ffn_dim": expert_ffn_dim,
            "renormalize": bool(hf.norm_topk_prob),
            "aux_loss_coef": float(hf.router_aux_loss_coef),
        },
    )


def softmax_moe_to_hf_state(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    hf = {"model.embed_tokens.weight": state["tok_embeddings.weight"], "model.norm.weight": state["norm.weight"]}
    if not config.tie_embeddings:
        hf["lm_head.weight"] = state["output.weight"]
    for index in range(config.n_layers):
        ours, theirs = f"layers.{index}.", f"model.layers.{index}."
        for name, hf_name in _layer_names(config).items():
            if ours + name in state:
                hf[theirs + hf_name] = state[ours + name]
        if index < config.dense_layers:
            for name, hf_name in _DENSE_NAMES.items():
                hf[theirs + hf_name] = state[ours + name]
            continue
        experts = ours + "ffn.experts."
        hf[theirs + "mlp.gate.weight"] = state[ours + "ffn.router.weight_ED"]
        hf[theirs + "mlp.experts.gate_up_proj"] = torch.cat(
            [state[experts + "w_gate_EFD"], state[experts + "w_up_EFD"]], dim=1
        )
        hf[theirs + "mlp.experts.down_proj"] = state[experts + "w_down_EDF"]
    return hf


def softmax_moe_from_hf_state(hf: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    state = {"tok_embeddings.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    state["output.weight"] = hf["model.embed_tokens.weight"] if config.tie_embeddings else hf["lm_head.weight"]
    for index in range(config.n_layers):
        ours, theirs = f"layers.{index}.", f"model.layers.{index}."
        for name, hf_name in _layer_names(config).items():
            if theirs + hf_name in hf:
                state[ours + name] = hf[theirs + hf_name]
        if index < config.dense_layers:
            for name, hf_name in _DENSE_NAMES.items():
                state[ours + name] = hf[theirs + hf_name]
            continue
        experts = ours + "ffn.experts."
        gate_up = hf[theirs + "mlp.experts.gate_up_proj"]
        width = gate_up.shape[1] // 2
        state[ours + "ffn.router.weight_ED"] = hf[theirs + "mlp.gate.weight"]
        state[ours + "ffn.router.expert_bias_E"] = torch.zeros(config.moe.num_experts, dtype=torch.float32)
        state[experts + "w_gate_EFD"] = gate_up[:, :width].contiguous()
        state[experts + "w_up_EFD"] = gate_up[:, width:].contiguous()
        state[experts + "w_down_EDF"] = hf[theirs + "mlp.experts.down_proj"]
    return state


def _layer_names(config: ModelConfig) -> dict[str, str]:
    """ferry's names of a layer's norms and attention tensors against transformers'."""
    return {
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        **config.attention_kind.hf_layer_names,
    }


_DENSE_NAMES = {
    "ffn.w_gate.weight": "mlp.gate_proj.weight",
    "ffn.w_up.weight": "mlp.up_proj.weight",
    "ffn.w_down.weight": "mlp.down_proj.weight",
}
