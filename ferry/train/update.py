"""An optimizer update after the backwards of a step: reduce, unscale, agree on finiteness, clip, step."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ferry.parallel.plan import ParallelPlan
from ferry.precision import LossScaler


class NonFiniteGradients(RuntimeError):
    """A step's gradients hold inf or NaN where no loss scaling expects them."""


def apply_gradients(
    plan: ParallelPlan,
    scaler: LossScaler,
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    device: torch.device,
    grad_clip: float,
    raise_on_nonfinite: bool,
    step: int,
) -> tuple[float, bool]:
    """Reduce, unscale, check, clip and step; the gradient norm and whether the optimizer stepped.

    A step whose gradients overflowed is skipped on every rank, leaving parameters and optimizer state untouched
    (or, with `raise_on_nonfinite` and no dynamic loss scaling, fails on every rank)."""
    plan.sync_gradients()
    finite = scaler.unscale_and_check(model.parameters())
    if plan.world is not None:
        overflow = torch.tensor([0.0 if finite else 1.0], device=device)
        finite = plan.world.all_reduce(overflow, op=dist.ReduceOp.MAX).item() == 0.0
    if not finite and raise_on_nonfinite and scaler.kind != "dynamic":
        raise NonFiniteGradients(
            f"step {step}: the gradients hold inf or NaN (fault.on_nonfinite: raise); a supervised run "
            "resumes from its last checkpoint"
        )
    grad_norm = plan.clip_gradients(model, grad_clip) if finite else float("nan")
    if finite:
        optimizer.step()
    scaler.update(finite)
    return grad_norm, finite
