"""The transformers architectures a ferry model can become, one kind a file: OLMoE and Qwen3-MoE (with what they
share, `softmax_moe.py`), DeepSeek-V3 and V2 (with `ferry/interop/deepseek.py`), GPT-OSS. Each answers what it
cannot express, its config and its weight names (`base.py`); `common.py` holds what they all share and the entry
points that ask the kind (`registry.py`) for the rest."""

from ferry.interop.architectures.common import (
    from_hf_state,
    hf_config,
    model_config_from_hf,
    natural_architecture,
    refusals,
    to_hf_state,
)
from ferry.interop.architectures.registry import ARCHITECTURE_KINDS, ARCHITECTURES

__all__ = [
    "ARCHITECTURES",
    "ARCHITECTURE_KINDS",
    "from_hf_state",
    "hf_config",
    "model_config_from_hf",
    "natural_architecture",
    "refusals",
    "to_hf_state",
]
