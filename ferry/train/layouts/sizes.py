"""The sizes the layout kinds and the memory model count in: the model's parameters (all, and the routed experts'),
and the bytes of a parameter, of a value the forward computes and of a reduced gradient, by the precision settings
(an accelerator profile computes and reduces in bf16 when the config leaves them unset)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ferry.model import count_model

_HALF = ("bf16", "fp16")


@dataclass(frozen=True)
class ParamCounts:
    total: int
    experts: int  # the routed experts' (a layer's [num_experts, ...] stacks)


def param_counts(config: Any) -> ParamCounts:
    model, moe = config.model, config.model.moe
    total = count_model(model, config.data.seq_len).total_params
    return ParamCounts(total, model.moe_layer_count * moe.num_experts * 3 * model.dim * moe.expert_ffn_dim)


def param_bytes(config: Any) -> int:
    return 2 if config.precision.param_dtype in _HALF else 4


def compute_bytes(config: Any, device: str) -> int:
    compute = config.precision.compute_dtype
    return 2 if compute in _HALF or (compute is None and device != "cpu") else 4


def activation_bytes(config: Any) -> int:
    """A forward's values as they travel (the run's device decides an unset compute dtype; `auto` counts as an
    accelerator's)."""
    return compute_bytes(config, config.run.device)


def reduce_bytes(config: Any) -> int:
    reduce = config.precision.reduce_dtype
    if reduce is not None:
        return 2 if reduce in _HALF else 4
    return param_bytes(config)
