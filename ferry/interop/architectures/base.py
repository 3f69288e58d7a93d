"""What an architecture kind answers (`ferry/interop/architectures/`), so that nothing else in ferry compares an
architecture's name: which ferry models it can express (and why not), its transformers config, the ferry fields a
transformers config of it describes, and the weight names on either side.

A kind is stateless, like the model's variant kinds: every answer is a function of the model config or the
transformers config it is asked about. What every architecture shares (the config fields, RoPE, the checks of the
skip wiring and the attention) is `common.py`'s, which asks the kind for the rest.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from ferry.model import ModelConfig


class ArchitectureKind(ABC):
    """One transformers architecture (`--arch`, transformers' `model_type`)."""

    name: ClassVar[str]
    attention: ClassVar[str]  # the attention kind it computes (`model.attention`)
    attention_words: ClassVar[str]  # that attention, in words, for a refusal
    keeps_mtp: ClassVar[bool] = False  # it has multi-token-prediction modules
    has_biases_sinks_windows: ClassVar[bool] = False  # projection biases, sinks, sliding windows, clamped experts
    yarn_attention_factor: ClassVar[bool] = False  # its YaRN keeps DeepSeek's magnitudes (only its own factor refused)

    def natural(self, config: ModelConfig) -> bool:
        """Whether it is the one an export of `config` defaults to (asked in the registry's order)."""
        return False

    @abstractmethod
    def refusals(self, config: ModelConfig, expert_bias_nonzero: bool) -> list[str]:
        """Why `config` cannot be written as this architecture, beyond what every architecture checks, each naming
        the ferry field."""

    @abstractmethod
    def hf_config(self, config: ModelConfig, common: dict[str, Any]) -> Any:
        """Its transformers config for `config`; `common` holds the fields every architecture shares."""

    @abstractmethod
    def model_fields(self, hf: Any, problems: list[str]) -> dict[str, Any]:
        """The ferry model fields its transformers config `hf` describes beyond those every architecture shares and
        its attention's; what ferry cannot compute is added to `problems`, naming the transformers field."""

    @abstractmethod
    def to_hf_state(self, state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        """ferry's state dict under its names and layouts."""

    @abstractmethod
    def from_hf_state(
        self, hf: dict[str, torch.Tensor], config: ModelConfig, rope_interleave: bool
    ) -> dict[str, torch.Tensor]:
        """Its state dict under ferry's names (the inverse of `to_hf_state`); `rope_interleave`: the checkpoint lays
        its rotary rows out in pairs."""
