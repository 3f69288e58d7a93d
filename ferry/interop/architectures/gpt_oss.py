"""GPT-OSS (`GptOssForCausalLM`): grouped-query attention with projection biases, a learned sink per head and
sliding-window layers alternating with full ones; experts with biases and a clamped SwiGLU; a router with a bias,
whose top-k logits are softmaxed (ferry's softmax, top-k and renormalisation: the same weights).

Its tensors differ in layout, not in content: the experts' gate and up projections are one `[E, D, 2F]` tensor
(input-major, gate and up interleaved column by column) and the down projection `[E, F, D]`; ferry keeps them as
`[E, F, D]` / `[E, D, F]` output-major matrices. Export writes every layer's `layer_types` out, so whatever
window pattern the model has is said, not implied.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ferry.interop.architectures.base import ArchitectureKind
from ferry.model import ModelConfig

SLIDING, FULL = "sliding_attention", "full_attention"


class GptOss(ArchitectureKind):
    name: ClassVar[str] = "gpt_oss"
    attention: ClassVar[str] = "gqa"
    attention_words: ClassVar[str] = "grouped-query attention"
    has_biases_sinks_windows: ClassVar[bool] = True

    def natural(self, config: ModelConfig) -> bool:
        """The grouped-query model with attention sinks."""
        return config.attention_kind.name == self.attention and config.attention_sinks

    def refusals(self, config: ModelConfig, expert_bias_nonzero: bool) -> list[str]:
        moe, problems = config.moe, []
        if not config.attention_sinks:
            problems.append("model.attention_sinks: every gpt_oss attention has a sink per head; the model has none")
        if config.qk_norm:
            problems.append("model.qk_norm: gpt_oss does not normalise queries and keys")
        if config.attention_gate != "none":
            problems.append(f"model.attention_gate {config.attention_gate!r}: gpt_oss has no attention output gate")
        if config.dense_layers:
            problems.append("model.dense_layers: every gpt_oss layer is MoE")
        if moe.activation != "clamped_swiglu":
            problems.append("model.moe.activation: gpt_oss's experts apply the clamped SwiGLU (clamped_swiglu)")
        if moe.score_func != "softmax" or not moe.renormalize:
            problems.append(
                "model.moe.score_func / renormalize: gpt_oss softmaxes the top-k logits (softmax, renormalize)"
            )
        if moe.n_group > 1 or moe.routed_scaling_factor != 1.0:
            problems.append("model.moe.n_group / routed_scaling_factor: gpt_oss routes without groups or scaling")
        if moe.shared_expert_ffn_dim:
            problems.append("model.moe.shared_expert_ffn_dim: gpt_oss has no shared expert")
        if expert_bias_nonzero:
            problems.append("model.moe.bias_balancing: gpt_oss has no expert-choice bias, and this model's is not zero")
        return problems

    def hf_config(self, config: ModelConfig, common: dict[str, Any]) -> Any:
        """transformers' `GptOssConfig` (the common fields gpt_oss has no place for are left out, its own written
        here)."""
        from transformers import GptOssConfig

        moe = config.moe
        fields = {key: value for key, value in common.items() if key not in ("num_experts", "norm_topk_prob")}
        fields.update(attention_bias=config.attention_bias, head_dim=config.head_dim)
        return GptOssConfig(
            num_local_experts=moe.num_experts,
            intermediate_size=moe.expert_ffn_dim,
            sliding_window=config.sliding_window or config.max_seq_len,  # transformers builds the mask even if unused
            layer_types=[SLIDING if config.attention_window(index) else FULL for index in range(config.n_layers)],
            swiglu_alpha=moe.swiglu_alpha,
            swiglu_limit=moe.swiglu_limit,
            **fields,
        )

    def model_fields(self, hf: Any, problems: list[str]) -> dict[str, Any]:
        """A window pattern ferry's `sliding_window_pattern` cannot say is refused."""
        window, pattern = _window_pattern(list(hf.layer_types), hf.sliding_window, problems)
        return dict(
            head_dim=hf.head_dim,
            attention_bias=bool(hf.attention_bias),
            attention_sinks=True,
            sliding_window=window,
            sliding_window_pattern=pattern,
            moe={
                "num_experts": hf.num_local_experts,
                "top_k": hf.num_experts_per_tok,
                "expert_ffn_dim": hf.intermediate_size,
                "score_func": "softmax",
                "renormalize": True,
                "router_bias": True,
                "expert_biases": True,
                "activation": "clamped_swiglu",
                "swiglu_alpha": float(hf.swiglu_alpha),
                "swiglu_limit": float(hf.swiglu_limit),
                "aux_loss_coef": float(hf.router_aux_loss_coef),
            },
        )

    def to_hf_state(self, state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        return _to_hf_state(state, config)

    def from_hf_state(
        self, hf: dict[str, torch.Tensor], config: ModelConfig, rope_interleave: bool
    ) -> dict[str, torch.Tensor]:
        return _from_hf_state(hf, config)


def _window_pattern(layer_types: list[str], sliding_window: int | None, problems: list[str]) -> tuple[int, int]:
    """`(sliding_window, sliding_window_pattern)` for transformers' `layer_types`: every pattern-th layer full."""
    windowed = [kind == SLIDING for kind in layer_types]
    if not any(windowed):
        return 0, 2
    pattern = 1 if all(windowed) else windowed.index(False) + 1
    if windowed != [pattern == 1 or bool((index + 1) % pattern) for index in range(len(windowed))]:
        problems.append(
            "layer_types: ferry windows every layer but each sliding_window_pattern-th; this pattern is another"
        )
    if not sliding_window:
        problems.append("sliding_window: sliding_attention layers with no window")
        return 0, 2
    return int(sliding_window), pattern


_ATTENTION_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.sinks_H": "self_attn.sinks",
    **{
        f"attn.{ours}.{part}": f"self_attn.{theirs}_proj.{part}"
        for ours, theirs in (("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "o"))
        for part in ("weight", "bias")
    },
}


def _to_hf_state(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """ferry's state dict under gpt_oss's names and layouts; a router or expert bias the model lacks is written
    as zeros (transformers' gpt_oss always has them)."""
    hf = {"model.embed_tokens.weight": state["tok_embeddings.weight"], "model.norm.weight": state["norm.weight"]}
    if not config.tie_embeddings:
        hf["lm_head.weight"] = state["output.weight"]
    for index in range(config.n_layers):
        ours, theirs = f"layers.{index}.", f"model.layers.{index}."
        for name, hf_name in _ATTENTION_NAMES.items():
            if ours + name in state:
                hf[theirs + hf_name] = state[ours + name]
        router, experts = ours + "ffn.router.", ours + "ffn.experts."
        weight_ED = state[router + "weight_ED"]
        hf[theirs + "mlp.router.weight"] = weight_ED
        hf[theirs + "mlp.router.bias"] = state.get(router + "bias_E", weight_ED.new_zeros(weight_ED.shape[0]))
        gate_EFD, up_EFD = state[experts + "w_gate_EFD"], state[experts + "w_up_EFD"]
        hf[theirs + "mlp.experts.gate_up_proj"] = _interleaved(gate_EFD, up_EFD, dim=1).transpose(1, 2).contiguous()
        hf[theirs + "mlp.experts.down_proj"] = state[experts + "w_down_EDF"].transpose(1, 2).contiguous()
        zeros_EF = gate_EFD.new_zeros(gate_EFD.shape[:2])
        hf[theirs + "mlp.experts.gate_up_proj_bias"] = _interleaved(
            state.get(experts + "bias_gate_EF", zeros_EF), state.get(experts + "bias_up_EF", zeros_EF), dim=1
        )
        hf[theirs + "mlp.experts.down_proj_bias"] = state.get(
            experts + "bias_down_ED", gate_EFD.new_zeros(gate_EFD.shape[0], gate_EFD.shape[2])
        )
    return hf


def _from_hf_state(hf: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers' gpt_oss state dict under ferry's names (the inverse of `_to_hf_state`)."""
    state = {"tok_embeddings.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    state["output.weight"] = hf["model.embed_tokens.weight"] if config.tie_embeddings else hf["lm_head.weight"]
    for index in range(config.n_layers):
        ours, theirs = f"layers.{index}.", f"model.layers.{index}."
        for name, hf_name in _ATTENTION_NAMES.items():
            if theirs + hf_name in hf:
                state[ours + name] = hf[theirs + hf_name]
        router, experts, mlp = ours + "ffn.router.", ours + "ffn.experts.", theirs + "mlp."
        state[router + "weight_ED"] = hf[mlp + "router.weight"]
        state[router + "bias_E"] = hf[mlp + "router.bias"]
        state[router + "expert_bias_E"] = torch.zeros(config.moe.num_experts, dtype=torch.float32)
        gate_up_EZD = hf[mlp + "experts.gate_up_proj"].transpose(1, 2)
        state[experts + "w_gate_EFD"] = gate_up_EZD[:, 0::2].contiguous()
        state[experts + "w_up_EFD"] = gate_up_EZD[:, 1::2].contiguous()
        state[experts + "w_down_EDF"] = hf[mlp + "experts.down_proj"].transpose(1, 2).contiguous()
        gate_up_bias_EZ = hf[mlp + "experts.gate_up_proj_bias"]
        state[experts + "bias_gate_EF"] = gate_up_bias_EZ[:, 0::2].contiguous()
        state[experts + "bias_up_EF"] = gate_up_bias_EZ[:, 1::2].contiguous()
        state[experts + "bias_down_ED"] = hf[mlp + "experts.down_proj_bias"]
    return state


def _interleaved(even: torch.Tensor, odd: torch.Tensor, dim: int) -> torch.Tensor:
    """`even` and `odd` alternating along `dim` (even first), as gpt_oss lays out gate and up."""
    return torch.stack([even, odd], dim=dim + 1).flatten(dim, dim + 1)
