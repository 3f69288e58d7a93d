"""DeepSeek-V3 (`DeepseekV3ForCausalLM`): multi-head latent attention; sigmoid scores plus a per-expert correction
bias for the choice only (ferry's bias balancing, whose bias it stores as `e_score_correction_bias`), group-limited
as ferry's router (a group ranked by the sum of its two best experts), normalised and scaled top-k weights; its
multi-token-prediction modules after the layers. What it shares with V2: `ferry/interop/deepseek.py`."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ferry.interop.architectures.base import ArchitectureKind
from ferry.interop.deepseek import (
    deepseek_config_fields,
    deepseek_from_hf_state,
    deepseek_model_fields,
    deepseek_refusals,
    deepseek_to_hf_state,
)
from ferry.model import ModelConfig


class DeepseekV3(ArchitectureKind):
    name: ClassVar[str] = "deepseek_v3"
    attention: ClassVar[str] = "mla"
    attention_words: ClassVar[str] = "multi-head latent attention"
    keeps_mtp: ClassVar[bool] = True
    yarn_attention_factor: ClassVar[bool] = True

    def natural(self, config: ModelConfig) -> bool:
        return config.attention_kind.name == self.attention

    def refusals(self, config: ModelConfig, expert_bias_nonzero: bool) -> list[str]:
        moe, problems = config.moe, deepseek_refusals(config, self.name)
        if moe.score_func != "sigmoid":
            problems.append(f"model.moe.score_func: deepseek_v3 routes with a sigmoid, the model uses {moe.score_func}")
        if moe.num_experts // moe.n_group < 2:
            problems.append(
                "model.moe.n_group: deepseek_v3 scores a group by its two best experts; give each group two"
            )
        if moe.n_group > 1 and moe.group_score != "top2_sum":
            problems.append("model.moe.group_score: deepseek_v3 ranks a group by its two best experts (top2_sum)")
        if expert_bias_nonzero and not moe.bias_balancing.enabled:
            problems.append(
                "model.moe.bias_balancing: the bias is not zero but unused here, and deepseek_v3 would use it"
            )
        return problems

    def hf_config(self, config: ModelConfig, common: dict[str, Any]) -> Any:
        """ferry rotates halves, so an export's rotary rows are not interleaved (`rope_interleave: false`)."""
        from transformers import DeepseekV3Config

        moe = config.moe
        return DeepseekV3Config(
            **deepseek_config_fields(config, common),
            rope_interleave=False,
            n_group=moe.n_group,
            topk_group=moe.topk_group,
            num_mtp_layers=config.mtp.depth,
        )

    def model_fields(self, hf: Any, problems: list[str]) -> dict[str, Any]:
        """Its multi-token-prediction modules (`num_mtp_layers`) are not among them: transformers' causal LM leaves
        their weights out, and the import reads them itself where the directory holds them
        (`ferry/interop/importing.py`)."""
        routing = {
            "score_func": "sigmoid",
            "renormalize": bool(hf.norm_topk_prob),
            "n_group": hf.n_group or 1,
            "topk_group": hf.topk_group or 1,
            "bias_balancing": {"enabled": True},
        }
        return deepseek_model_fields(hf, routing)

    def to_hf_state(self, state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        return deepseek_to_hf_state(state, config, interleaved=False, correction_bias=True)

    def from_hf_state(
        self, hf: dict[str, torch.Tensor], config: ModelConfig, rope_interleave: bool
    ) -> dict[str, torch.Tensor]:
        return deepseek_from_hf_state(hf, config, interleaved=rope_interleave, correction_bias=True)
