"""Low-precision expert GEMMs inside the run's kernel selection.

The selection binds the composed expert ops (`moe.expert_mlp`, `moe.routed_experts`)
to the chosen `moe.grouped_mm`. Wrapping that one function in the recipe's
low-precision GEMM and binding the compositions again makes every expert GEMM,
forward and backward, round its operands as the recipe prescribes. A composed op
whose chosen implementation does not go through `moe.grouped_mm` (a fused vendor
kernel) falls back to its portable composition, and the reason is recorded.
"""

from __future__ import annotations

from functools import partial

import torch

from ferry.kernels import REGISTRY, KernelSelection
from ferry.kernels.selection import Choice, bind
from ferry.precision.recipe import EmulatedLowPrecisionGroupedMM, LowPrecisionRecipe

GROUPED_MM = "moe.grouped_mm"


def with_low_precision_experts(selection: KernelSelection, recipe: LowPrecisionRecipe) -> KernelSelection:
    """The same selection with the expert GEMMs in `recipe`'s numerics (emulated on any device)."""
    functions: dict = {}
    choices: dict[str, Choice] = {}
    for name, choice in selection.choices.items():
        implementation, reason = choice.implementation, choice.reason
        if name == GROUPED_MM:
            fn = partial(_low_precision_grouped_mm, recipe=recipe, matmul=choice.fn)
            reason = f"{reason}; operands rounded to {recipe.kind} ({recipe.forward_format.dtype} forward)"
        else:
            portable = REGISTRY[name].portable
            if _composes_grouped_mm(portable, choices) and not _composes_grouped_mm(implementation, choices):
                implementation = portable
                reason = f"portable: precision.experts={recipe.kind} needs the {GROUPED_MM} composition"
            fn = bind(implementation, functions)
        functions[name] = fn
        choices[name] = Choice(implementation, reason, fn)
    return KernelSelection(selection.policy, selection.device, selection.platform, choices)


def _composes_grouped_mm(implementation, choices: dict[str, Choice]) -> bool:
    return any(
        used == GROUPED_MM or _composes_grouped_mm(choices[used].implementation, choices)
        for used in implementation.uses
    )


def _low_precision_grouped_mm(x_NI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor, *, recipe, matmul):
    return EmulatedLowPrecisionGroupedMM.apply(x_NI, w_EOI, offsets_E, recipe, matmul)
