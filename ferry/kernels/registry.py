"""The op registry: named ops, each with one portable implementation and optional vendor ones.

An op is a contract (a signature and its semantics, written in the op's summary).
Its portable implementation is pure PyTorch and runs on every device; a vendor
implementation is tied to one platform and may need a library, a compute
capability or a dtype, which its probe checks. Keeping the two kinds apart is
what lets a run drop every vendor kernel by configuration and still train.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

import torch

Platform = Literal["cpu", "cuda", "rocm", "xpu", "mps"]
PLATFORMS: tuple[str, ...] = get_args(Platform)
PORTABLE = "portable"

Probe = Callable[[torch.device, torch.dtype], "str | None"]


class RecipeRefused(ValueError):
    """A low-precision implementation cannot compute the recipe it was handed (another element format than
    its kernel takes): the caller picks another implementation, and the bench lists it as unavailable."""


def platform_of(device: torch.device) -> str:
    """The platform key of a device; ROCm builds expose AMD GPUs as `cuda` devices."""
    if device.type == "cuda" and torch.version.hip:
        return "rocm"
    return device.type


def always_available(device: torch.device, dtype: torch.dtype) -> str | None:
    return None


@dataclass(frozen=True)
class Implementation:
    """One way to compute an op; `platform` is None for the portable implementation.

    `uses` names ops that `fn` is composed of: selection passes their chosen
    functions as keyword arguments named after the op's last part
    (`moe.grouped_mm` -> `grouped_mm=`), so a composition follows every choice.
    `recipe_refusal`, for a low-precision implementation whose kernel takes fixed element
    formats, says why it cannot compute a recipe (None: it can); the precision layer asks
    before binding the recipe, so a refusal is known at start, not at the first forward.
    `replay_refusal` says why the implementation cannot run under activation checkpointing, whose recompute must
    issue the ops of the first run in the same order (`ferry/kernels/recompute_policy.py`); None: it can.
    """

    op: str
    name: str
    fn: Callable
    summary: str
    platform: str | None = None
    probe: Probe = always_available
    uses: tuple[str, ...] = ()
    recipe_refusal: Callable[[object], str | None] | None = None
    replay_refusal: str | None = None

    @property
    def portable(self) -> bool:
        return self.platform is None

    @property
    def key(self) -> str:
        """`name` for the portable implementation, `name@platform` for a vendor one."""
        return self.name if self.portable else f"{self.name}@{self.platform}"

    @property
    def source(self) -> Path:
        """The file holding the implementation (the unit that the boundary report counts)."""
        return Path(inspect.getsourcefile(inspect.unwrap(self.fn)))

    def unavailable_reason(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """None when it can run on `device` with `dtype`, else why not (in words a user can act on)."""
        here = platform_of(device)
        if self.platform is not None and self.platform != here:
            return f"it is built for {self.platform} and this device is {here}"
        return self.probe(device, dtype)


@dataclass(frozen=True)
class Op:
    """A named op: its contract, its portable implementation, its vendor ones in preference order."""

    name: str
    summary: str
    portable: Implementation
    vendor: tuple[Implementation, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.portable.portable or self.portable.name != PORTABLE:
            raise ValueError(f"{self.name}: the portable implementation must be named {PORTABLE!r} with no platform")
        for impl in self.vendor:
            if impl.portable or impl.platform not in PLATFORMS:
                raise ValueError(f"{self.name}: vendor implementation {impl.name!r} needs a platform in {PLATFORMS}")
        keys = [impl.key for impl in self.implementations]
        if len(set(keys)) != len(keys):
            raise ValueError(f"{self.name}: implementation keys repeat: {keys}")

    @property
    def implementations(self) -> tuple[Implementation, ...]:
        return (self.portable, *self.vendor)

    def named(self, name: str) -> list[Implementation]:
        """The implementations called `name` (a vendor name may exist for several platforms)."""
        return [impl for impl in self.implementations if impl.name == name]


class Registry:
    """All ops by name; selection and the boundary report read it, model code never does."""

    def __init__(self, ops: list[Op]):
        self._ops: dict[str, Op] = {}
        for op in ops:
            for impl in op.implementations:
                missing = [name for name in impl.uses if name not in self._ops]
                if missing:
                    raise ValueError(f"{impl.key} of {op.name} uses {missing}, which must be registered before it")
            self._ops[op.name] = op

    def __getitem__(self, name: str) -> Op:
        return self._ops[name]

    def __contains__(self, name: str) -> bool:
        return name in self._ops

    def __iter__(self) -> Iterator[Op]:
        return iter(self._ops.values())

    @property
    def names(self) -> list[str]:
        return list(self._ops)

    def vendor_implementations(self) -> list[Implementation]:
        return [impl for op in self for impl in op.vendor]
