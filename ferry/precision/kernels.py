"""Low-precision expert GEMMs inside the run's kernel selection.

The recipe's kind names a kernel op (`moe.fp8_grouped_mm`, `moe.mxfp8_grouped_mm`)
whose implementation the selection has already chosen: the portable emulation, or a
vendor GEMM that computes the format natively. Binding that op, with the recipe, in
place of `moe.grouped_mm` inside the composed expert ops (`moe.expert_mlp`,
`moe.routed_experts`) makes every expert GEMM, forward and backward, quantize its
operands as the recipe prescribes. A composed op whose chosen implementation does not
go through `moe.grouped_mm` (a fused vendor kernel) falls back to its portable
composition, and the reason is recorded.
"""

from __future__ import annotations

from functools import partial

from ferry.config import UserError
from ferry.kernels import REGISTRY, KernelSelection
from ferry.kernels.selection import Choice, bind
from ferry.precision.recipe import LowPrecisionRecipe

GROUPED_MM = "moe.grouped_mm"
LOW_PRECISION_OPS = ("moe.fp8_grouped_mm", "moe.mxfp8_grouped_mm")


def low_precision_op(recipe: LowPrecisionRecipe) -> str:
    """The kernel op that computes the expert GEMMs of `recipe`."""
    return f"moe.{recipe.kind}_grouped_mm"


def with_low_precision_experts(selection: KernelSelection, recipe: LowPrecisionRecipe) -> KernelSelection:
    """The same selection with the expert GEMMs in `recipe`'s numerics, by the chosen low-precision op.

    A vendor implementation whose kernel cannot compute the recipe (other element formats) gives way to
    the portable emulation when `auto` chose it, with the reason recorded; pinned, it is a `UserError`.
    """
    op = low_precision_op(recipe)
    low = selection.choices[op]
    refusal = low.implementation.recipe_refusal
    reason = refusal(recipe) if refusal is not None else None
    if reason is not None and low.pinned:
        raise UserError(f'kernels.ops."{op}": {low.implementation.key} cannot run this recipe: {reason}')
    if reason is not None:
        portable = REGISTRY[op].portable
        chosen = {name: choice.fn for name, choice in selection.choices.items()}
        low = Choice(portable, f"auto: {low.implementation.key} refuses the recipe: {reason}", bind(portable, chosen))
        selection = KernelSelection(
            selection.policy, selection.device, selection.platform, {**selection.choices, op: low}
        )
    functions: dict = {}
    choices: dict[str, Choice] = {}
    for name, choice in selection.choices.items():
        implementation, reason = choice.implementation, choice.reason
        if name == GROUPED_MM:
            fn = partial(low.fn, recipe=recipe)
            reason = f"{reason}; inside {low.implementation.op} {low.implementation.key} ({recipe.kind})"
        elif name in LOW_PRECISION_OPS:
            fn = choice.fn  # bound to the high-precision moe.grouped_mm it wraps
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
