"""How RoPE's frequencies are scaled to extend a model's context: the `model.rope_scaling` section, beside the
code it configures (`ferry/model/rope.py`)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from ferry.config.section import Section


class RopeScalingConfig(Section):
    """How RoPE reaches past the length a model was trained at (a long-context stage sets it).

    `linear` is position interpolation (Chen et al. 2023, arXiv:2306.15595): every frequency
    divided by `factor`. `yarn` (Peng et al. 2023, arXiv:2309.00071) interpolates only the
    frequencies that turn less than `beta_slow` times over `original_max_seq_len`, keeps
    those that turn more than `beta_fast` times, ramps between, and scales the attention
    logits by 0.1 ln(factor) + 1 (through cos and sin). The base-frequency change of ABF
    (Xiong et al. 2023, arXiv:2309.16039) is `rope_theta` itself.
    """

    kind: Literal["none", "linear", "yarn"] = "none"
    factor: float = Field(1.0, ge=1.0, description="how many times longer than original_max_seq_len")
    original_max_seq_len: int | None = Field(None, ge=1, description="yarn: the length the model was trained at")
    beta_fast: float = Field(32.0, gt=0.0)
    beta_slow: float = Field(1.0, gt=0.0)
    mscale: float | None = Field(None, gt=0.0, description="yarn, DeepSeek's form: see `attention_factor`")
    mscale_all_dim: float | None = Field(None, gt=0.0, description="yarn, DeepSeek's form: see `softmax_factor`")
    truncate: bool = Field(
        True,
        description="yarn: round the ramp's ends to whole dimensions (floor and ceiling), as the paper's code does; "
        "false keeps them exact, as GPT-OSS is trained",
    )

    @model_validator(mode="after")
    def _yarn_knows_its_origin(self) -> RopeScalingConfig:
        if self.kind == "yarn" and self.original_max_seq_len is None:
            raise ValueError("yarn needs original_max_seq_len (the length the model was trained at)")
        if self.kind != "yarn" and not self.truncate:
            raise ValueError("truncate: false shapes yarn's ramp (kind: yarn)")
        if self.kind != "yarn" and (self.mscale is not None or self.mscale_all_dim is not None):
            raise ValueError("mscale and mscale_all_dim belong to yarn scaling (kind: yarn)")
        return self

    def _magnitude(self, mscale: float = 1.0) -> float:
        """YaRN's 0.1 * mscale * ln(factor) + 1 (1 when nothing is stretched)."""
        return 0.1 * mscale * math.log(self.factor) + 1.0 if self.factor > 1.0 else 1.0

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by: the paper's 0.1 ln(factor) + 1; with both of DeepSeek's
        `mscale` and `mscale_all_dim`, the ratio of their magnitudes (1 when they are equal, as in DeepSeek-V3,
        whose logits are scaled through the softmax instead)."""
        if self.kind != "yarn":
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return self._magnitude(self.mscale) / self._magnitude(self.mscale_all_dim)
        return self._magnitude()

    @property
    def softmax_factor(self) -> float:
        """What MLA's softmax scale is multiplied by: the square of the `mscale_all_dim` magnitude, so that the
        positional-free part of each head's logits is sharpened too, as DeepSeek's reference code does."""
        if self.kind != "yarn" or not self.mscale_all_dim:
            return 1.0
        return self._magnitude(self.mscale_all_dim) ** 2
