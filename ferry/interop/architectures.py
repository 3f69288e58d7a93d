"""The transformers architectures a ferry model can become (OLMoE, Qwen3-MoE, DeepSeek-V3, DeepSeek-V2, GPT-OSS):
which ferry configs each can express, its config built with transformers' own class, and the weight names on
either side. DeepSeek-V3 and V2 (multi-head latent attention; sigmoid or softmax group-limited routing) have their
own file, `deepseek.py`; GPT-OSS (sinks, windows, biases, clamped experts) its own, `gpt_oss.py`.

Both route with a softmax in fp32, then top-k, then an optional renormalisation, exactly as ferry's
router; they differ in the query/key norm (OLMoE: one norm over the whole projection; Qwen3-MoE: per
head) and in dense layers (only Qwen3-MoE has them, as `mlp_only_layers`). Anything else a ferry
config can say and the target cannot is refused, naming the field, before a file is written.
"""

from __future__ import annotations

from typing import Literal

import torch

from ferry.config import UserError
from ferry.interop.deepseek import (
    deepseek_from_hf_state,
    deepseek_hf_config,
    deepseek_model_fields,
    deepseek_refusals,
    deepseek_to_hf_state,
)
from ferry.interop.gpt_oss import (
    gpt_oss_from_hf_state,
    gpt_oss_hf_config,
    gpt_oss_model_fields,
    gpt_oss_refusals,
    gpt_oss_to_hf_state,
)
from ferry.model import ModelConfig
from ferry.model.variants import ATTENTION_KINDS

Architecture = Literal["olmoe", "qwen3_moe", "deepseek_v3", "deepseek_v2", "gpt_oss"]
ARCHITECTURES: tuple[str, ...] = ("olmoe", "qwen3_moe", "deepseek_v3", "deepseek_v2", "gpt_oss")
DEEPSEEK = ("deepseek_v3", "deepseek_v2")
GPT_OSS_PARTS = (  # what only gpt_oss has: (the ferry field, the part)
    ("attention_bias", "attention projection biases"),
    ("attention_sinks", "attention sinks"),
    ("sliding_window", "sliding-window attention"),
    ("moe.router_bias", "a router bias"),
    ("moe.expert_biases", "expert biases"),
)


def refusals(config: ModelConfig, arch: str, expert_bias_nonzero: bool = False) -> list[str]:
    """Every reason `config` cannot be written as `arch`, each naming the ferry field."""
    if arch not in ARCHITECTURES:
        return [f"--arch {arch!r}: choose one of {', '.join(ARCHITECTURES)}"]
    problems = config.skip_kind.export_refusals(config, arch) + config.attention_kind.export_refusals(config, arch)
    if config.mtp.depth and arch != "deepseek_v3":
        problems.append(f"model.mtp.depth: {arch} has no multi-token-prediction modules (deepseek_v3 keeps them)")
    if arch == "gpt_oss":
        return problems + gpt_oss_refusals(config, expert_bias_nonzero)
    problems += _gpt_oss_parts(config, arch)
    if arch in DEEPSEEK:
        return problems + deepseek_refusals(config, expert_bias_nonzero, arch)
    moe = config.moe
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
    wanted_scope = "projection" if arch == "olmoe" else "head"
    if config.qk_norm and config.qk_norm_scope != wanted_scope:
        problems.append(
            f"model.qk_norm_scope: {arch} normalises per {wanted_scope}, the model per {config.qk_norm_scope}"
        )
    if arch == "olmoe" and config.dense_layers:
        problems.append("model.dense_layers: OLMoE has no dense layers (qwen3_moe has, as mlp_only_layers)")
    return problems


def _gpt_oss_parts(config: ModelConfig, arch: str) -> list[str]:
    """The parts of `config` that only gpt_oss can hold, refused for `arch`."""
    problems = [
        f"model.{field}: {arch} has no {part} (gpt_oss has)"
        for field, part in GPT_OSS_PARTS
        if getattr(config.moe if field.startswith("moe.") else config, field.removeprefix("moe."))
    ]
    if config.moe.activation != "swiglu":
        problems.append(
            f"model.moe.activation {config.moe.activation!r}: {arch}'s experts are SwiGLU (gpt_oss's clamped)"
        )
    return problems


def natural_architecture(config: ModelConfig) -> str:
    """The architecture `--arch` defaults to: its attention kind's (DeepSeek-V3 for MLA; for GQA, the one whose
    query/key norm the model has)."""
    return config.attention_kind.hf_architecture(config)


def hf_config(config: ModelConfig, arch: str, eos_token_id: int | None, dtype: str):
    """The transformers config for `config`, every routing and RoPE setting written explicitly."""
    from transformers import OlmoeConfig, Qwen3MoeConfig

    moe = config.moe
    common = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        **config.attention_kind.hf_config_fields(config, arch),
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tie_embeddings,
        rope_parameters=_rope_parameters(config),
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        norm_topk_prob=moe.renormalize,
        router_aux_loss_coef=moe.aux_loss_coef,
        output_router_logits=False,
        attention_bias=False,
        initializer_range=config.init_std,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        dtype=dtype,
    )
    if arch in DEEPSEEK:
        return deepseek_hf_config(config, common, arch)
    if arch == "gpt_oss":
        return gpt_oss_hf_config(config, common)
    if arch == "olmoe":
        return OlmoeConfig(intermediate_size=moe.expert_ffn_dim, clip_qkv=None, **common)
    return Qwen3MoeConfig(
        intermediate_size=config.dense_ffn_dim,
        moe_intermediate_size=moe.expert_ffn_dim,
        mlp_only_layers=list(range(config.dense_layers)),
        decoder_sparse_step=1,
        use_sliding_window=False,
        **common,
    )


def _rope_parameters(config: ModelConfig) -> dict:
    """RoPE as transformers names it: the base, and the scaling with every parameter written out."""
    scaling = config.rope_scaling
    if scaling.kind == "none":
        return {"rope_type": "default", "rope_theta": config.rope_theta}
    if scaling.kind == "linear":
        return {"rope_type": "linear", "rope_theta": config.rope_theta, "factor": scaling.factor}
    deepseek_magnitudes = {
        key: value for key, value in (("mscale", scaling.mscale), ("mscale_all_dim", scaling.mscale_all_dim)) if value
    }
    return {
        "rope_type": "yarn",
        "rope_theta": config.rope_theta,
        "factor": scaling.factor,
        "original_max_position_embeddings": scaling.original_max_seq_len,
        "beta_fast": scaling.beta_fast,
        "beta_slow": scaling.beta_slow,
        "truncate": scaling.truncate,
        **deepseek_magnitudes,
    }


def _rope_scaling(rope: dict, problems: list[str], arch: str) -> dict:
    """The inverse of `_rope_parameters`; another RoPE type, or a YaRN with its own attention factor (or DeepSeek's
    magnitudes, outside DeepSeek-V3), is refused."""
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return {"kind": "none"}
    if kind == "linear":
        return {"kind": "linear", "factor": float(rope["factor"])}
    if kind == "yarn":
        own = ("attention_factor",) if arch in DEEPSEEK else ("attention_factor", "mscale", "mscale_all_dim")
        custom = [key for key in own if rope.get(key) is not None]
        if custom:
            problems.append(f"rope_parameters {custom}: ferry's YaRN has the paper's attention factor")
        magnitudes = {key: float(rope[key]) for key in ("mscale", "mscale_all_dim") if rope.get(key)}
        return {
            "kind": "yarn",
            "factor": float(rope["factor"]),
            "original_max_seq_len": int(rope["original_max_position_embeddings"]),
            "beta_fast": float(rope.get("beta_fast") or 32.0),
            "beta_slow": float(rope.get("beta_slow") or 1.0),
            "truncate": rope.get("truncate") is not False,
            **magnitudes,
        }
    problems.append(f"rope_parameters.rope_type {kind!r}: ferry has default, linear and yarn RoPE")
    return {"kind": "none"}


def model_config_from_hf(hf) -> tuple[ModelConfig, str]:
    """The ferry model config an OLMoE or Qwen3-MoE transformers config describes; anything ferry's model
    cannot compute the same way is refused, naming the transformers field."""
    arch = hf.model_type
    if arch not in ARCHITECTURES:
        raise UserError(f"model_type {arch!r}: ferry imports {', '.join(ARCHITECTURES)}")
    rope = getattr(hf, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": getattr(hf, "rope_theta", 10000.0),
    }
    problems: list[str] = []
    rope_scaling = _rope_scaling(rope, problems, arch)
    if getattr(hf, "attention_bias", False) and arch != "gpt_oss":
        problems.append("attention_bias: ferry's attention projections have no bias")
    if getattr(hf, "clip_qkv", None) is not None:
        problems.append("clip_qkv: ferry does not clip queries, keys and values")
    if getattr(hf, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf.hidden_act!r}: ferry's experts are SwiGLU (silu)")
    attention = next(kind for kind in ATTENTION_KINDS.values() if arch in kind.hf_architectures)
    dense_layers = 0
    if arch == "qwen3_moe":
        dense = sorted(hf.mlp_only_layers or [])
        sparse = [i for i in range(hf.num_hidden_layers) if i not in dense and (i + 1) % hf.decoder_sparse_step == 0]
        dense_layers = hf.num_hidden_layers - len(sparse)
        if sparse != list(range(dense_layers, hf.num_hidden_layers)):
            problems.append("mlp_only_layers / decoder_sparse_step: ferry's dense layers are the first ones only")
        if getattr(hf, "use_sliding_window", False):
            problems.append("use_sliding_window: ferry's attention is full causal attention")
    shared = dict(
        vocab_size=hf.vocab_size,
        dim=hf.hidden_size,
        n_layers=hf.num_hidden_layers,
        n_heads=hf.num_attention_heads,
        max_seq_len=hf.max_position_embeddings,
        rope_theta=float(rope["rope_theta"]),
        rope_scaling=rope_scaling,
        norm_eps=float(hf.rms_norm_eps),
        tie_embeddings=bool(hf.tie_word_embeddings),
        init_std=float(hf.initializer_range),
        **attention.fields_from_hf(hf, problems),
    )
    if getattr(hf, "mlp_bias", False):
        problems.append("mlp_bias: ferry's feed-forward projections have no bias")
    if arch in DEEPSEEK:
        fields = deepseek_model_fields(hf)
    elif arch == "gpt_oss":
        fields = gpt_oss_model_fields(hf, problems)
    else:
        fields = dict(
            qk_norm=True,
            qk_norm_scope="projection" if arch == "olmoe" else "head",
            dense_layers=dense_layers,
            dense_ffn_dim=hf.intermediate_size if arch == "qwen3_moe" else ModelConfig().dense_ffn_dim,
            moe={
                "num_experts": hf.num_experts,
                "top_k": hf.num_experts_per_tok,
                "expert_ffn_dim": hf.moe_intermediate_size if arch == "qwen3_moe" else hf.intermediate_size,
                "renormalize": bool(hf.norm_topk_prob),
                "aux_loss_coef": float(hf.router_aux_loss_coef),
            },
        )
    if problems:
        raise UserError("cannot import this model: " + "; ".join(problems))
    return ModelConfig.model_validate({**shared, **fields}), arch


def to_hf_state(
    state: dict[str, torch.Tensor], config: ModelConfig, arch: str | None = None
) -> dict[str, torch.Tensor]:
    """ferry's state dict (routers' zero expert biases dropped) under the names of `arch` (default: the model's
    natural architecture)."""
    arch = arch or natural_architecture(config)
    if arch in DEEPSEEK:
        return deepseek_to_hf_state(state, config, arch)
    if arch == "gpt_oss":
        return gpt_oss_to_hf_state(state, config)
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


def from_hf_state(
    hf: dict[str, torch.Tensor], config: ModelConfig, rope_interleave: bool = False, arch: str | None = None
) -> dict[str, torch.Tensor]:
    """transformers' state dict of `arch` (default: the model's natural architecture) back under ferry's names
    (the inverse of `to_hf_state`); `rope_interleave` says a DeepSeek-V3 checkpoint lays its rotary rows out in
    pairs, as every DeepSeek-V2 checkpoint does."""
    arch = arch or natural_architecture(config)
    if arch in DEEPSEEK:
        return deepseek_from_hf_state(hf, config, rope_interleave or arch == "deepseek_v2", arch)
    if arch == "gpt_oss":
        return gpt_oss_from_hf_state(hf, config)
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
