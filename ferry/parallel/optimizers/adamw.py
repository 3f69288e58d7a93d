"""`optim.name: adamw`: torch's AdamW over every parameter, its fused kernel wherever the device has one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from ferry.config.refusals import Refusal
from ferry.parallel.optimizers.base import OptimizerMemory, OptimizerRecipe, Params

if TYPE_CHECKING:
    from ferry.comm import Collectives


def fused_where_available(params: list[nn.Parameter]) -> dict:
    """AdamW's fused kernel (one pass over each tensor for the whole update) where torch has one for the
    parameters' device, else its default. The per-tensor loop torch picks by default on a CPU made five
    passes over every parameter and moment: 7% of a CPU step of a small MoE."""
    devices = {p.device.type for p in params}
    return {"fused": True} if params and devices <= set(_get_fused_kernels_supported_devices()) else {}


def adamw_over(params: Params, decayed: frozenset[str] | set[str], weight_decay: float, **hyperparameters):
    """torch's AdamW over `params`, decaying only the `decayed` names (also the AdamW part of other kinds)."""
    return torch.optim.AdamW(
        [
            {"params": [p for n, p in params if n in decayed], "weight_decay": weight_decay},
            {"params": [p for n, p in params if n not in decayed], "weight_decay": 0.0},
        ],
        **hyperparameters,
        **fused_where_available([p for _, p in params]),
    )


class AdamWKind:
    name: ClassVar[str] = "adamw"
    state_kind: ClassVar[str] = "AdamW"
    state_held: ClassVar[str] = "AdamW moments"
    state_carried: ClassVar[str] = "AdamW moments and step counts"

    def settings(self, optim: Any, model: nn.Module) -> None:
        return None

    def build(self, recipe: OptimizerRecipe, params: Params, shard_owners: Collectives | None) -> torch.optim.Optimizer:
        return adamw_over(params, recipe.decayed, recipe.weight_decay, **recipe.hyperparameters)

    def refusals(self, config: Any) -> list[Refusal]:
        return []

    def memory(
        self,
        config: Any,
        params: int,
        expert_params: int,
        param_bytes: int,
        experts_split_over: int,
        weights_sharded_over: int,
    ) -> OptimizerMemory:
        """Two fp32 moments a parameter; the step's temporary (the square root of the second moments, in the
        foreach implementation torch uses by default) is counted from them by the memory model."""
        return OptimizerMemory(adamw_share=1.0, working_bytes=0.0)


def adamw_recipe(decayed: set[str] | frozenset[str], weight_decay: float, **hyperparameters) -> OptimizerRecipe:
    """An AdamW recipe, for the code that builds an optimizer without a run config (benchmarks, tests)."""
    return OptimizerRecipe(AdamWKind(), frozenset(decayed), weight_decay, hyperparameters)
