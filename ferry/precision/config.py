"""Precision configuration: dtypes, loss scaling and low-precision expert GEMMs.

Every field left unset (null) is taken from the hardware profile's defaults, so a
run config only states what it deliberately changes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from ferry.config.section import Section
from ferry.platform.hardware import profile_names

Dtype = Literal["fp32", "bf16", "fp16"]


class LossScalingConfig(Section):
    """`dynamic` skips a step whose gradients overflow, backs off, and grows again after a calm run."""

    kind: Literal["none", "static", "dynamic"] | None = Field(None, description="null: the profile's default")
    init_scale: float = Field(65536.0, gt=0.0)
    growth_factor: float = Field(2.0, gt=1.0)
    backoff_factor: float = Field(0.5, gt=0.0, lt=1.0)
    growth_interval: int = Field(200, ge=1, description="overflow-free steps before the scale grows")


class PrecisionConfig(Section):
    profile: str | None = Field(
        None,
        min_length=1,
        description="take the defaults and FP8 variant from this hardware profile instead of the run's: another "
        "accelerator's numerics rehearsed on this hardware (native support still depends on the run's hardware)",
    )
    param_dtype: Dtype | None = Field(None, description="dtype the parameters are stored in")
    compute_dtype: Dtype | None = Field(None, description="autocast dtype of forward and backward")
    reduce_dtype: Dtype | None = Field(None, description="dtype of gradient reductions across ranks")
    loss_scaling: LossScalingConfig = LossScalingConfig()
    weight_casts: Literal["step", "micro_batch"] = Field(
        "step",
        description="with compute_dtype below param_dtype: step casts the GEMM weights once per optimizer step and "
        "adds each micro-batch's gradient into the fp32 one in one fused kernel (ferry/precision/step_weights.py); "
        "micro_batch leaves both to autocast at every use. The same numbers either way",
    )
    experts: Literal["none", "fp8", "mxfp8"] = Field("none", description="low-precision expert GEMMs")
    gradient_format: Literal["auto", "e4m3", "e5m2"] = Field(
        "auto",
        description="element format of the experts' gradients; auto: e4m3 for fp8, e5m2 for mxfp8 (e4m3 is what "
        "torchao's MXFP8 kernel computes)",
    )
    on_unsupported: Literal["emulate", "error"] = Field(
        "emulate", description="when the hardware lacks the experts' format natively"
    )

    @field_validator("profile")
    @classmethod
    def _profile_exists(cls, name: str | None) -> str | None:
        if name is not None and name not in profile_names():
            raise ValueError(f"unknown hardware profile {name!r}; profiles: {', '.join(profile_names())}")
        return name
