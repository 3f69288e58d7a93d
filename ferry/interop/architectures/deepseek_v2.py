"""DeepSeek-V2 (`DeepseekV2ForCausalLM`): multi-head latent attention; a softmax and no bias, the top-k weights scaled
but never renormalised (transformers' router ignores `norm_topk_prob`), over every expert (`topk_method: greedy`)
or within the `topk_group` groups whose best expert scores highest (`group_limited_greedy`: ferry's
`group_score: max`). Its checkpoints always lay the rotary rows out in pairs: an export interleaves them, an import
moves them into halves. What it shares with V3: `ferry/interop/deepseek.py`."""

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


class DeepseekV2(ArchitectureKind):
    name: ClassVar[str] = "deepseek_v2"
    attention: ClassVar[str] = "mla"
    attention_words: ClassVar[str] = "multi-head latent attention"
    yarn_attention_factor: ClassVar[bool] = True

    def refusals(self, config: ModelConfig, expert_bias_nonzero: bool) -> list[str]:
        moe, problems = config.moe, deepseek_refusals(config, self.name)
        if moe.score_func != "softmax":
            problems.append(f"model.moe.score_func: deepseek_v2 routes with a softmax, the model uses {moe.score_func}")
        if moe.renormalize:
            problems.append("model.moe.renormalize: transformers' deepseek_v2 never renormalises the top-k weights")
        if moe.topk_group < moe.n_group and moe.group_score != "max":
            problems.append("model.moe.group_score: deepseek_v2 ranks a group by its best expert (max)")
        if expert_bias_nonzero:
            problems.append(
                "model.moe.bias_balancing: deepseek_v2 has no expert-choice bias, and this model's is not zero"
            )
        return problems

    def hf_config(self, config: ModelConfig, common: dict[str, Any]) -> Any:
        from transformers import DeepseekV2Config

        moe = config.moe
        limited = moe.topk_group < moe.n_group
        return DeepseekV2Config(
            **deepseek_config_fields(config, common),
            topk_method="group_limited_greedy" if limited else "greedy",
            n_group=moe.n_group if limited else None,
            topk_group=moe.topk_group if limited else None,
        )

    def model_fields(self, hf: Any, problems: list[str]) -> dict[str, Any]:
        routing: dict[str, Any] = {"score_func": "softmax", "renormalize": False}
        if hf.topk_method == "group_limited_greedy":
            routing.update(n_group=hf.n_group, topk_group=hf.topk_group, group_score="max")
        return deepseek_model_fields(hf, routing)

    def to_hf_state(self, state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        return deepseek_to_hf_state(state, config, interleaved=True, correction_bias=False)

    def from_hf_state(
        self, hf: dict[str, torch.Tensor], config: ModelConfig, rope_interleave: bool
    ) -> dict[str, torch.Tensor]:
        return deepseek_from_hf_state(hf, config, interleaved=True, correction_bias=False)
