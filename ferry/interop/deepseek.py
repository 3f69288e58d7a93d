"""DeepSeek-V3 (`DeepseekV3ForCausalLM`): the transformers architecture of ferry's MLA models.

It routes with sigmoid scores plus a per-expert correction bias for the choice only (ferry's bias
balancing, whose bias it stores as `e_score_correction_bias`), group-limited as ferry's router,
with normalised and scaled top-k weights; its shared experts are one SwiGLU of `n_shared_experts`
expert widths (ferry's `shared_expert_ffn_dim`); its first `first_k_dense_replace` layers are dense.

RoPE: DeepSeek's checkpoints lay each rotary slice out in interleaved pairs (`rope_interleave`),
which rotates exactly as rotate-half does after the slice's even dimensions are moved before its
odd ones. ferry rotates halves: an export says `rope_interleave: false`, an import of an interleaved
checkpoint moves those weight rows once.
"""

from __future__ import annotations

import torch

from ferry.model import ModelConfig
from ferry.model.variants.mla import MultiHeadLatentAttention

LATENT_NORM_EPS = 1e-6  # transformers builds DeepSeek-V3's latent norms with this eps, whatever rms_norm_eps is


def deepseek_refusals(config: ModelConfig, expert_bias_nonzero: bool) -> list[str]:
    """Every reason `config` cannot be written as DeepSeek-V3, each naming the ferry field."""
    moe, problems = config.moe, []
    if config.attention_gate != "none":
        problems.append(
            f"model.attention_gate {config.attention_gate!r}: transformers has no gated MLA model; "
            "keep the checkpoint in ferry's format (or train with attention_gate: none)"
        )
    if moe.score_func != "sigmoid":
        problems.append(f"model.moe.score_func: deepseek_v3 routes with a sigmoid, the model uses {moe.score_func}")
    if moe.shared_expert_ffn_dim % moe.expert_ffn_dim:
        problems.append(
            f"model.moe.shared_expert_ffn_dim {moe.shared_expert_ffn_dim}: deepseek_v3's shared experts are a "
            f"whole number of expert widths ({moe.expert_ffn_dim})"
        )
    if moe.num_experts // moe.n_group < 2:
        problems.append("model.moe.n_group: deepseek_v3 scores a group by its two best experts; give each group two")
    if expert_bias_nonzero and not moe.bias_balancing.enabled:
        problems.append("model.moe.bias_balancing: the bias is not zero but unused here, and deepseek_v3 would use it")
    if config.mla.latent_norm_eps != LATENT_NORM_EPS:
        problems.append(f"model.mla.latent_norm_eps: deepseek_v3's latent norms use {LATENT_NORM_EPS}")
    return problems


def deepseek_hf_config(config: ModelConfig, common: dict):
    """transformers' `DeepseekV3Config` for `config`; `common` holds the fields every architecture shares."""
    from transformers import DeepseekV3Config

    moe = config.moe
    fields = {key: value for key, value in common.items() if key != "num_experts"}
    return DeepseekV3Config(
        **fields,
        n_routed_experts=moe.num_experts,
        intermediate_size=config.dense_ffn_dim,
        moe_intermediate_size=moe.expert_ffn_dim,
        n_shared_experts=moe.shared_expert_ffn_dim // moe.expert_ffn_dim,
        routed_scaling_factor=moe.routed_scaling_factor,
        n_group=moe.n_group,
        topk_group=moe.topk_group,
        first_k_dense_replace=config.dense_layers,
        num_mtp_layers=0,
    )


def deepseek_model_fields(hf) -> dict:
    """The ferry model fields (beyond those every architecture shares and its attention's) a `DeepseekV3Config`
    describes. Its multi-token-prediction modules (`num_mtp_layers`) serve speculative decoding only;
    transformers' causal LM leaves them out of its forward and its weights, and so does ferry."""
    routed = hf.n_routed_experts
    return {
        "dense_layers": min(hf.first_k_dense_replace or 0, hf.num_hidden_layers),
        "dense_ffn_dim": hf.intermediate_size,
        "moe": {
            "num_experts": routed,
            "top_k": hf.num_experts_per_tok,
            "expert_ffn_dim": hf.moe_intermediate_size,
            "score_func": "sigmoid",
            "renormalize": bool(hf.norm_topk_prob),
            "shared_expert_ffn_dim": hf.n_shared_experts * hf.moe_intermediate_size,
            "n_group": hf.n_group or 1,
            "topk_group": hf.topk_group or 1,
            "routed_scaling_factor": float(hf.routed_scaling_factor),
            "bias_balancing": {"enabled": True},
            "aux_loss_coef": float(getattr(hf, "router_aux_loss_coef", 0.0)),
        },
    }


def deepseek_to_hf_state(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """ferry's state dict under DeepSeek-V3's names."""
    hf = {"model.embed_tokens.weight": state["tok_embeddings.weight"], "model.norm.weight": state["norm.weight"]}
    if not config.tie_embeddings:
        hf["lm_head.weight"] = state["output.weight"]
    for index in range(config.n_layers):
        ours, theirs = f"layers.{index}.", f"model.layers.{index}."
        for name, hf_name in _layer_names(index < config.dense_layers).items():
            if ours + name in state:
                hf[theirs + hf_name] = state[ours + name]
        if index >= config.dense_layers:
            experts = ours + "ffn.experts."
            gate_up = torch.cat([state[experts + "w_gate_EFD"], state[experts + "w_up_EFD"]], dim=1)
            hf[theirs + "mlp.experts.gate_up_proj"] = gate_up
            if not config.moe.shared_expert_ffn_dim:  # DeepSeek-V3 builds its shared experts even when there are none
                for name, shape in _EMPTY_SHARED.items():
                    hf[theirs + name] = torch.empty(shape(config.dim))
    return hf


def deepseek_from_hf_state(
    hf: dict[str, torch.Tensor], config: ModelConfig, interleaved: bool
) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's state dict under ferry's names; `interleaved` rotary rows are moved to rotate-half order."""
    state = {"tok_embeddings.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    state["output.weight"] = hf["model.embed_tokens.weight"] if config.tie_embeddings else hf["lm_head.weight"]
    for index in range(config.n_layers):
        ours, theirs = f"layers.{index}.", f"model.layers.{index}."
        for name, hf_name in _layer_names(index < config.dense_layers).items():
            if theirs + hf_name in hf and hf[theirs + hf_name].numel():  # no empty shared experts: ferry has none
                state[ours + name] = hf[theirs + hf_name]
        if index >= config.dense_layers:
            gate_up = hf[theirs + "mlp.experts.gate_up_proj"]
            width = gate_up.shape[1] // 2
            state[ours + "ffn.experts.w_gate_EFD"] = gate_up[:, :width].contiguous()
            state[ours + "ffn.experts.w_up_EFD"] = gate_up[:, width:].contiguous()
        if interleaved:
            _rotate_half_order(state, ours + "attn.", config)
    return state


def _rotate_half_order(state: dict[str, torch.Tensor], attn: str, config: ModelConfig) -> None:
    """Move the rows that make each rotary slice from interleaved pairs (x0, x1, x2, ...) to (x0, x2, ..., x1,
    x3, ...): the query's per head, the shared key's once."""
    mla = config.mla
    rope = mla.qk_rope_head_dim
    order_R = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    query = attn + ("wq_b.weight" if mla.q_lora_rank else "wq.weight")
    q_HKI = state[query].view(config.n_heads, mla.qk_head_dim, -1)
    nope = mla.qk_nope_head_dim
    state[query] = torch.cat([q_HKI[:, :nope], q_HKI[:, nope:][:, order_R]], dim=1).flatten(0, 1)
    kv = state[attn + "wkv_a.weight"]
    state[attn + "wkv_a.weight"] = torch.cat([kv[: mla.kv_lora_rank], kv[mla.kv_lora_rank :][order_R]])


_EMPTY_SHARED = {
    "mlp.shared_experts.gate_proj.weight": lambda dim: (0, dim),
    "mlp.shared_experts.up_proj.weight": lambda dim: (0, dim),
    "mlp.shared_experts.down_proj.weight": lambda dim: (dim, 0),
}


def _layer_names(dense: bool) -> dict[str, str]:
    """ferry's names of a layer's tensors (those a layer has) against DeepSeek-V3's (the attention's: MLA's)."""
    names = {
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        **MultiHeadLatentAttention.hf_layer_names,
    }
    if dense:
        return {**names, "ffn.w_gate.weight": "mlp.gate_proj.weight", "ffn.w_up.weight": "mlp.up_proj.weight",
                "ffn.w_down.weight": "mlp.down_proj.weight"}
    return {
        **names,
        "ffn.router.weight_ED": "mlp.gate.weight",
        "ffn.router.expert_bias_E": "mlp.gate.e_score_correction_bias",
        "ffn.experts.w_down_EDF": "mlp.experts.down_proj",
        "ffn.shared_expert.w_gate.weight": "mlp.shared_experts.gate_proj.weight",
        "ffn.shared_expert.w_up.weight": "mlp.shared_experts.up_proj.weight",
        "ffn.shared_expert.w_down.weight": "mlp.shared_experts.down_proj.weight",
    }
