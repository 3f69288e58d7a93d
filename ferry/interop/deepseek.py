"""What DeepSeek-V3 (`DeepseekV3ForCausalLM`) and DeepSeek-V2 (`DeepseekV2ForCausalLM`), the transformers
architectures of ferry's MLA models, share; each is a kind of its own (`ferry/interop/architectures/deepseek_v3.py`,
`deepseek_v2.py`) that routes as below.

DeepSeek-V3 routes with sigmoid scores plus a per-expert correction bias for the choice only (ferry's bias
balancing, whose bias it stores as `e_score_correction_bias`), group-limited as ferry's router (a group
ranked by the sum of its two best experts), with normalised and scaled top-k weights. DeepSeek-V2 routes
with a softmax and no bias, its top-k weights scaled but never renormalised (transformers' router ignores
`norm_topk_prob`), either over every expert (`topk_method: greedy`) or within the `topk_group` groups whose
best expert scores highest (`group_limited_greedy`: ferry's `group_score: max`). Both have shared experts
of `n_shared_experts` expert widths (ferry's `shared_expert_ffn_dim`) and dense first
`first_k_dense_replace` layers, and the same attention and expert weight names.

RoPE: DeepSeek's checkpoints lay each rotary slice out in interleaved pairs (V3's `rope_interleave`; V2
always, its rotation a complex product of pairs), which rotates exactly as rotate-half does after the
slice's even dimensions are moved before its odd ones. ferry rotates halves: a V3 export says
`rope_interleave: false`, a V2 export moves the rotary weight rows back into pairs, and an import of an
interleaved checkpoint moves them once into halves.
"""

from __future__ import annotations

import torch

from ferry.model import ModelConfig
from ferry.model.variants.mla import MultiHeadLatentAttention

LATENT_NORM_EPS = 1e-6  # transformers builds DeepSeek-V3's latent norms with this eps, whatever rms_norm_eps is


def deepseek_refusals(config: ModelConfig, arch: str) -> list[str]:
    """Why `config` cannot be written as either DeepSeek (`arch`, for the messages), each naming the ferry field:
    what both share. Each architecture adds its routing's."""
    moe, problems = config.moe, []
    if config.attention_gate != "none":
        problems.append(
            f"model.attention_gate {config.attention_gate!r}: transformers has no gated MLA model; "
            "keep the checkpoint in ferry's format (or train with attention_gate: none)"
        )
    if moe.shared_expert_ffn_dim % moe.expert_ffn_dim:
        problems.append(
            f"model.moe.shared_expert_ffn_dim {moe.shared_expert_ffn_dim}: {arch}'s shared experts are a "
            f"whole number of expert widths ({moe.expert_ffn_dim})"
        )
    if config.mla.latent_norm_eps != LATENT_NORM_EPS:
        problems.append(f"model.mla.latent_norm_eps: {arch}'s latent norms use {LATENT_NORM_EPS}")
    return problems


def deepseek_config_fields(config: ModelConfig, common: dict) -> dict:
    """The transformers config fields both DeepSeeks have for `config`, from those every architecture shares."""
    moe = config.moe
    return {
        **{key: value for key, value in common.items() if key != "num_experts"},
        "n_routed_experts": moe.num_experts,
        "intermediate_size": config.dense_ffn_dim,
        "moe_intermediate_size": moe.expert_ffn_dim,
        "n_shared_experts": moe.shared_expert_ffn_dim // moe.expert_ffn_dim,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "first_k_dense_replace": config.dense_layers,
    }


def deepseek_model_fields(hf, routing: dict) -> dict:
    """The ferry model fields (beyond those every architecture shares and its attention's) a DeepSeek config
    describes, its `routing` (score function, groups, renormalisation) the architecture's own."""
    moe = {
        "num_experts": hf.n_routed_experts,
        "top_k": hf.num_experts_per_tok,
        "expert_ffn_dim": hf.moe_intermediate_size,
        "shared_expert_ffn_dim": hf.n_shared_experts * hf.moe_intermediate_size,
        "routed_scaling_factor": float(hf.routed_scaling_factor),
        "aux_loss_coef": float(getattr(hf, "router_aux_loss_coef", 0.0) or 0.0),
        **routing,
    }
    return {
        "dense_layers": min(hf.first_k_dense_replace or 0, hf.num_hidden_layers),
        "dense_ffn_dim": hf.intermediate_size,
        "moe": moe,
    }


def deepseek_to_hf_state(
    state: dict[str, torch.Tensor], config: ModelConfig, interleaved: bool, correction_bias: bool
) -> dict[str, torch.Tensor]:
    """ferry's state dict under DeepSeek's names; with `interleaved` (V2), the rotary rows in interleaved pairs;
    with `correction_bias` (V3), the routers' expert-choice bias. Multi-token-prediction modules follow the
    layers, at indices `n_layers` onward, as DeepSeek-V3's checkpoints keep them (each with a copy of the embedding
    and the head, as theirs)."""
    block = (interleaved, correction_bias)
    hf = {"model.embed_tokens.weight": state["tok_embeddings.weight"], "model.norm.weight": state["norm.weight"]}
    if not config.tie_embeddings:
        hf["lm_head.weight"] = state["output.weight"]
    for index in range(config.n_layers):
        _block_to_hf(
            state, f"layers.{index}.", f"model.layers.{index}.", index < config.dense_layers, config, block, hf
        )
    for depth in range(config.mtp.depth):
        ours, theirs = f"mtp.{depth}.", f"model.layers.{config.n_layers + depth}."
        _block_to_hf(state, ours + "block.", theirs, config.n_layers == config.dense_layers, config, block, hf)
        hf.update({theirs + hf_name: state[ours + name] for name, hf_name in _MTP_NAMES.items()})
        hf[theirs + "embed_tokens.weight"] = state["tok_embeddings.weight"]
        hf[theirs + "shared_head.head.weight"] = state["output.weight"]
    return hf


def deepseek_from_hf_state(
    hf: dict[str, torch.Tensor], config: ModelConfig, interleaved: bool, correction_bias: bool
) -> dict[str, torch.Tensor]:
    """DeepSeek's state dict under ferry's names; `interleaved` rotary rows are moved to rotate-half order. Without
    a `correction_bias` (V2) the routers' expert-choice bias is zero. The MTP modules `config` has are read from the
    layers after the model's (their copies of the embedding and the head are the model's)."""
    state = {"tok_embeddings.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    state["output.weight"] = hf["model.embed_tokens.weight"] if config.tie_embeddings else hf["lm_head.weight"]
    for index in range(config.n_layers):
        dense = index < config.dense_layers
        _block_from_hf(
            hf, f"layers.{index}.", f"model.layers.{index}.", dense, config, interleaved, correction_bias, state
        )
    for depth in range(config.mtp.depth):
        ours, theirs = f"mtp.{depth}.", f"model.layers.{config.n_layers + depth}."
        dense = config.n_layers == config.dense_layers
        _block_from_hf(hf, ours + "block.", theirs, dense, config, interleaved, correction_bias, state)
        state.update({ours + name: hf[theirs + hf_name] for name, hf_name in _MTP_NAMES.items()})
    return state


def _block_to_hf(
    state: dict[str, torch.Tensor],
    ours: str,
    theirs: str,
    dense: bool,
    config: ModelConfig,
    block: tuple[bool, bool],
    hf: dict,
) -> None:
    """One block's tensors (a layer's, or an MTP module's) into `hf` under DeepSeek's layer names; `block`: whether
    its rotary rows are interleaved and whether its routers keep a correction bias."""
    interleaved, correction_bias = block
    attention = _interleaved_order(state, ours + "attn.", config) if interleaved else {}
    for name, hf_name in _layer_names(dense, correction_bias).items():
        if ours + name in state:
            hf[theirs + hf_name] = attention.get(ours + name, state[ours + name])
    if not dense:
        gate_up = [state[ours + "ffn.experts.w_gate_EFD"], state[ours + "ffn.experts.w_up_EFD"]]
        hf[theirs + "mlp.experts.gate_up_proj"] = torch.cat(gate_up, dim=1)
        if not config.moe.shared_expert_ffn_dim:  # DeepSeek-V3 builds its shared experts even when there are none
            for name, shape in _EMPTY_SHARED.items():
                hf[theirs + name] = torch.empty(shape(config.dim))


def _block_from_hf(
    hf: dict[str, torch.Tensor],
    ours: str,
    theirs: str,
    dense: bool,
    config: ModelConfig,
    interleaved: bool,
    correction_bias: bool,
    state: dict[str, torch.Tensor],
) -> None:
    """One block's tensors from DeepSeek's layer names into `state` (the inverse of `_block_to_hf`)."""
    for name, hf_name in _layer_names(dense, correction_bias).items():
        if theirs + hf_name in hf and hf[theirs + hf_name].numel():  # no empty shared experts: ferry has none
            state[ours + name] = hf[theirs + hf_name]
    if not dense and not correction_bias:
        state[ours + "ffn.router.expert_bias_E"] = torch.zeros(config.moe.num_experts, dtype=torch.float32)
    if not dense:
        gate_up = hf[theirs + "mlp.experts.gate_up_proj"]
        width = gate_up.shape[1] // 2
        state[ours + "ffn.experts.w_gate_EFD"] = gate_up[:, :width].contiguous()
        state[ours + "ffn.experts.w_up_EFD"] = gate_up[:, width:].contiguous()
    if interleaved:
        _rotate_half_order(state, ours + "attn.", config)


def mtp_layer_prefixes(num_hidden_layers: int, depth: int) -> list[str]:
    """The transformers-side prefixes of `depth` MTP modules after `num_hidden_layers` layers."""
    return [f"model.layers.{num_hidden_layers + depth_index}." for depth_index in range(depth)]


_MTP_NAMES = {  # an MTP module's own tensors, beside its block's
    "embed_norm.weight": "enorm.weight",
    "hidden_norm.weight": "hnorm.weight",
    "proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}


def _rotate_half_order(state: dict[str, torch.Tensor], attn: str, config: ModelConfig) -> None:
    """Move the rows that make each rotary slice from interleaved pairs (x0, x1, x2, ...) to (x0, x2, ..., x1,
    x3, ...): the query's per head, the shared key's once."""
    state.update(_reordered_rotary(state, attn, config, _halves_R(config.mla.qk_rope_head_dim)))


def _interleaved_order(state: dict[str, torch.Tensor], attn: str, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The query and latent projections with each rotary slice's rows moved from rotate-half order back into
    interleaved pairs (the inverse of `_rotate_half_order`), under ferry's names."""
    return _reordered_rotary(state, attn, config, torch.argsort(_halves_R(config.mla.qk_rope_head_dim)))


def _halves_R(rope: int) -> torch.Tensor:
    """The interleaved rows in rotate-half order: the even ones, then the odd ones."""
    return torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])


def _reordered_rotary(
    state: dict[str, torch.Tensor], attn: str, config: ModelConfig, order_R: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The query projection's and the key/value latent projection's weights with the rows of every rotary slice
    taken in `order_R`."""
    mla = config.mla
    query = attn + ("wq_b.weight" if mla.q_lora_rank else "wq.weight")
    q_HKI = state[query].view(config.n_heads, mla.qk_head_dim, -1)
    nope = mla.qk_nope_head_dim
    kv = state[attn + "wkv_a.weight"]
    return {
        query: torch.cat([q_HKI[:, :nope], q_HKI[:, nope:][:, order_R]], dim=1).flatten(0, 1),
        attn + "wkv_a.weight": torch.cat([kv[: mla.kv_lora_rank], kv[mla.kv_lora_rank :][order_R]]),
    }


_EMPTY_SHARED = {
    "mlp.shared_experts.gate_proj.weight": lambda dim: (0, dim),
    "mlp.shared_experts.up_proj.weight": lambda dim: (0, dim),
    "mlp.shared_experts.down_proj.weight": lambda dim: (dim, 0),
}


def _layer_names(dense: bool, correction_bias: bool = True) -> dict[str, str]:
    """ferry's names of a layer's tensors (those a layer has) against DeepSeek's (the attention's: MLA's); a
    router's expert-choice bias where the architecture keeps one (V3's `e_score_correction_bias`)."""
    names = {
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        **MultiHeadLatentAttention.hf_layer_names,
    }
    if dense:
        return {
            **names,
            "ffn.w_gate.weight": "mlp.gate_proj.weight",
            "ffn.w_up.weight": "mlp.up_proj.weight",
            "ffn.w_down.weight": "mlp.down_proj.weight",
        }
    bias = {"ffn.router.expert_bias_E": "mlp.gate.e_score_correction_bias"} if correction_bias else {}
    return {
        **names,
        "ffn.router.weight_ED": "mlp.gate.weight",
        **bias,
        "ffn.experts.w_down_EDF": "mlp.experts.down_proj",
        "ffn.shared_expert.w_gate.weight": "mlp.shared_experts.gate_proj.weight",
        "ffn.shared_expert.w_up.weight": "mlp.shared_experts.up_proj.weight",
        "ffn.shared_expert.w_down.weight": "mlp.shared_experts.down_proj.weight",
    }
