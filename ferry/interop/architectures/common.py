"""What every transformers architecture a ferry model can become shares (OLMoE, Qwen3-MoE, DeepSeek-V3, DeepSeek-V2,
GPT-OSS, each a kind of its own in this package): the checks of the skip wiring, the attention, the
multi-token-prediction modules and the parts only some architectures hold; the config fields they all have and
RoPE; and the entry points that ask the architecture's kind for the rest. Anything a ferry config can say and the
target cannot is refused, naming the field, before a file is written.
"""

from __future__ import annotations

import torch

from ferry.config import UserError
from ferry.interop.architectures.base import ArchitectureKind
from ferry.interop.architectures.registry import ARCHITECTURE_KINDS, ARCHITECTURES
from ferry.model import ModelConfig
from ferry.model.variants import ATTENTION_KINDS

EXTRA_PARTS = (  # what only an architecture with biases, sinks and windows holds: (the ferry field, the part)
    ("attention_bias", "attention projection biases"),
    ("attention_sinks", "attention sinks"),
    ("sliding_window", "sliding-window attention"),
    ("moe.router_bias", "a router bias"),
    ("moe.expert_biases", "expert biases"),
)


def refusals(config: ModelConfig, arch: str, expert_bias_nonzero: bool = False) -> list[str]:
    """Every reason `config` cannot be written as `arch`, each naming the ferry field."""
    kind = ARCHITECTURE_KINDS.get(arch)
    if kind is None:
        return [f"--arch {arch!r}: choose one of {', '.join(ARCHITECTURES)}"]
    problems = config.skip_kind.export_refusals(config, arch)
    if config.attention_kind is not ATTENTION_KINDS[kind.attention]:
        problems.append(
            f"model.attention: {arch} has {kind.attention_words} ({kind.attention}), the model {config.attention}"
        )
    if config.mtp.depth and not kind.keeps_mtp:
        keepers = ", ".join(other.name for other in ARCHITECTURE_KINDS.values() if other.keeps_mtp)
        problems.append(f"model.mtp.depth: {arch} has no multi-token-prediction modules ({keepers} keeps them)")
    if not kind.has_biases_sinks_windows:
        problems += _extra_parts(config, arch)
    return problems + kind.refusals(config, expert_bias_nonzero)


def _extra_parts(config: ModelConfig, arch: str) -> list[str]:
    """The parts of `config` that only an architecture with biases, sinks and windows can hold, refused for
    `arch`."""
    holders = ", ".join(kind.name for kind in ARCHITECTURE_KINDS.values() if kind.has_biases_sinks_windows)
    problems = [
        f"model.{field}: {arch} has no {part} ({holders} has)"
        for field, part in EXTRA_PARTS
        if getattr(config.moe if field.startswith("moe.") else config, field.removeprefix("moe."))
    ]
    if config.moe.activation != "swiglu":
        problems.append(
            f"model.moe.activation {config.moe.activation!r}: {arch}'s experts are SwiGLU ({holders}'s clamped)"
        )
    return problems


def natural_architecture(config: ModelConfig) -> str:
    """The architecture `--arch` defaults to: the first kind that takes the model (DeepSeek-V3 for MLA; for GQA,
    GPT-OSS with sinks, else the one whose query/key norm and layers the model has)."""
    return next(kind.name for kind in ARCHITECTURE_KINDS.values() if kind.natural(config))


def hf_config(config: ModelConfig, arch: str, eos_token_id: int | None, dtype: str):
    """The transformers config for `config`, every routing and RoPE setting written explicitly."""
    moe = config.moe
    common = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        **config.attention_kind.hf_config_fields(config),
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
    return _kind(arch).hf_config(config, common)


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


def _rope_scaling(rope: dict, problems: list[str], arch: ArchitectureKind) -> dict:
    """The inverse of `_rope_parameters`; another RoPE type, or a YaRN with its own attention factor (or DeepSeek's
    magnitudes, outside an architecture that keeps them), is refused."""
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return {"kind": "none"}
    if kind == "linear":
        return {"kind": "linear", "factor": float(rope["factor"])}
    if kind == "yarn":
        own = ("attention_factor",) if arch.yarn_attention_factor else ("attention_factor", "mscale", "mscale_all_dim")
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
    """The ferry model config a transformers config of one of the architectures describes; anything ferry's model
    cannot compute the same way is refused, naming the transformers field."""
    arch = hf.model_type
    if arch not in ARCHITECTURE_KINDS:
        raise UserError(f"model_type {arch!r}: ferry imports {', '.join(ARCHITECTURES)}")
    kind = ARCHITECTURE_KINDS[arch]
    rope = getattr(hf, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": getattr(hf, "rope_theta", 10000.0),
    }
    problems: list[str] = []
    rope_scaling = _rope_scaling(rope, problems, kind)
    if getattr(hf, "attention_bias", False) and not kind.has_biases_sinks_windows:
        problems.append("attention_bias: ferry's attention projections have no bias")
    if getattr(hf, "clip_qkv", None) is not None:
        problems.append("clip_qkv: ferry does not clip queries, keys and values")
    if getattr(hf, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf.hidden_act!r}: ferry's experts are SwiGLU (silu)")
    fields = kind.model_fields(hf, problems)
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
        **ATTENTION_KINDS[kind.attention].fields_from_hf(hf, problems),
    )
    if getattr(hf, "mlp_bias", False):
        problems.append("mlp_bias: ferry's feed-forward projections have no bias")
    if problems:
        raise UserError("cannot import this model: " + "; ".join(problems))
    return ModelConfig.model_validate({**shared, **fields}), arch


def to_hf_state(
    state: dict[str, torch.Tensor], config: ModelConfig, arch: str | None = None
) -> dict[str, torch.Tensor]:
    """ferry's state dict (routers' zero expert biases dropped) under the names of `arch` (default: the model's
    natural architecture)."""
    return _kind(arch or natural_architecture(config)).to_hf_state(state, config)


def from_hf_state(
    hf: dict[str, torch.Tensor], config: ModelConfig, rope_interleave: bool = False, arch: str | None = None
) -> dict[str, torch.Tensor]:
    """transformers' state dict of `arch` (default: the model's natural architecture) back under ferry's names
    (the inverse of `to_hf_state`); `rope_interleave` says a DeepSeek-V3 checkpoint lays its rotary rows out in
    pairs, as every DeepSeek-V2 checkpoint does."""
    return _kind(arch or natural_architecture(config)).from_hf_state(hf, config, rope_interleave)


def _kind(arch: str) -> ArchitectureKind:
    kind = ARCHITECTURE_KINDS.get(arch)
    if kind is None:
        raise UserError(f"--arch {arch!r}: choose one of {', '.join(ARCHITECTURES)}")
    return kind
