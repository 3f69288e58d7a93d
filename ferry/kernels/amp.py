"""Kernel ops compute in the dtypes of the tensors they are given: autocast stops at an op's boundary.

Autocast would otherwise recast some of the matmuls inside an implementation and
not others (calls with `out=` are never recast), so results of mixed dtypes would
meet inside it, and two implementations of one op would round differently. The
caller decides an op's precision by the dtypes it passes in.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def outside_autocast(fn: Callable) -> Callable:
    """Run `fn` with autocast off on the device of its first tensor argument."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        device = next(arg.device for arg in args if isinstance(arg, torch.Tensor))
        with torch.autocast(device.type, enabled=False):
            return fn(*args, **kwargs)

    return wrapper


def in_autocast_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in autocast's dtype while autocast is on for their device, as they are otherwise.

    For ops whose operands are parameters rather than outputs of autocast ops (the
    expert weights): they compute in the dtypes they are given, so they follow
    `precision.compute_dtype` only if their caller casts. The casts are differentiable;
    fp32 parameters receive fp32 gradients through them.
    """
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(tensor.to(dtype) for tensor in tensors)
