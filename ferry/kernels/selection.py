"""Choose one implementation per op, once, before the model is built.

The model holds the chosen functions, so a forward pass never consults the
registry, the ledger or the device again: a choice is made at start, logged, and
written into the run record, and it cannot drift during a run.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ferry.config import UserError
from ferry.kernels.catalogue import REGISTRY
from ferry.kernels.config import KernelsConfig
from ferry.kernels.ledger import Ledger, load_ledger
from ferry.kernels.registry import PORTABLE, Implementation, Op, Registry, platform_of


@dataclass(frozen=True)
class Choice:
    """One op's implementation, why it was chosen, and its function with any sub-ops bound."""

    implementation: Implementation
    reason: str
    fn: Callable
    pinned: bool = False


@dataclass(frozen=True)
class KernelSelection:
    """The implementation of every op for one device, with the reason each was chosen."""

    policy: str
    device: str
    platform: str
    choices: dict[str, Choice]

    def __getitem__(self, op_name: str) -> Callable:
        """The chosen function, its sub-ops already bound (what a model module keeps)."""
        return self.choices[op_name].fn

    @property
    def functions(self) -> dict[str, Callable]:
        return {name: choice.fn for name, choice in self.choices.items()}

    @property
    def vendor_ops(self) -> list[str]:
        return [name for name, choice in self.choices.items() if not choice.implementation.portable]

    def as_dict(self) -> dict:
        """For `run.json`: enough to rerun with the same kernels, or to see why they differ."""
        return {
            "policy": self.policy,
            "device": self.device,
            "platform": self.platform,
            "ops": {
                name: {"implementation": choice.implementation.key, "reason": choice.reason}
                for name, choice in self.choices.items()
            },
        }

    def describe(self) -> str:
        """One line for the start-of-run log."""
        vendor = ", ".join(f"{name}={self.choices[name].implementation.key}" for name in self.vendor_ops)
        return f"kernels: policy {self.policy} on {self.platform} — " + (
            f"vendor {vendor}; the other {len(self.choices) - len(self.vendor_ops)} ops portable"
            if vendor
            else f"all {len(self.choices)} ops portable"
        )


def select_kernels(
    config: KernelsConfig,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    *,
    registry: Registry = REGISTRY,
    ledger: Ledger | None = None,
    today: datetime.date | None = None,
    replayed: bool = False,
) -> KernelSelection:
    """Resolve `config` for `device` and parameter `dtype`; an impossible request is a `UserError`. `replayed`:
    blocks are recomputed in the backward (activation checkpointing), so only implementations that can be are
    chosen, and pinning one that cannot is refused."""
    device = torch.device(device)
    ledger = ledger if ledger is not None else load_ledger()
    today = today or datetime.date.today()
    choices: dict[str, Choice] = {}
    functions: dict[str, Callable] = {}
    for op in registry:  # in registration order, so the parts of a composed op are chosen first
        pinned = op.name in config.ops
        if pinned:
            impl, reason = _pinned(op, config.ops[op.name], device, dtype, ledger, today)
            if replayed and impl.replay_refusal:
                raise UserError(
                    f'kernels.ops."{op.name}": {impl.key} cannot run under train.activation_checkpointing: '
                    f"{impl.replay_refusal}; unpin it or set train.activation_checkpointing=none"
                )
        elif config.policy == "auto":
            impl, reason = _auto(op, device, dtype, ledger, today, replayed)
        else:
            impl, reason = op.portable, "policy portable"
        functions[op.name] = bind(impl, functions)
        choices[op.name] = Choice(impl, reason, functions[op.name], pinned)
    return KernelSelection(config.policy, str(device), platform_of(device), choices)


@functools.cache
def portable_kernels() -> KernelSelection:
    """Every op's portable implementation: what a model built without a selection runs."""
    return select_kernels(KernelsConfig(policy="portable"), "cpu")


def bind(impl: Implementation, functions: dict[str, Callable]) -> Callable:
    """`impl.fn` with the functions of the ops it is composed of passed in (see `Implementation.uses`)."""
    if not impl.uses:
        return impl.fn
    return functools.partial(impl.fn, **{name.rsplit(".", 1)[-1]: functions[name] for name in impl.uses})


def _pinned(
    op: Op, name: str, device: torch.device, dtype: torch.dtype, ledger: Ledger, today: datetime.date
) -> tuple[Implementation, str]:
    key = f'kernels.ops."{op.name}"'
    if name == PORTABLE:
        return op.portable, f"{key} pins it"
    candidates = op.named(name)
    if not candidates:
        known = ", ".join(sorted({impl.name for impl in op.implementations}))
        raise UserError(f"{key}: no implementation {name!r}; {op.name} has {known}")
    here = platform_of(device)
    for impl in candidates:
        if impl.platform == here:
            reason = impl.unavailable_reason(device, dtype)
            if reason is not None:
                raise UserError(f"{key}: {impl.key} is not available on {device} ({dtype}): {reason}")
            return impl, f"{key} pins it; ledger: {ledger.status(impl, today)}" + _against_bf16(ledger, impl)
    platforms = ", ".join(impl.platform for impl in candidates)
    raise UserError(f"{key}: {name} is not available on {device}: it is built for {platforms}, this device is {here}")


def _auto(
    op: Op, device: torch.device, dtype: torch.dtype, ledger: Ledger, today: datetime.date, replayed: bool = False
) -> tuple[Implementation, str]:
    skipped = []
    for impl in op.vendor:
        if impl.platform != platform_of(device):
            continue
        reason = impl.unavailable_reason(device, dtype)
        if reason is None and replayed and impl.replay_refusal:
            reason = f"not under activation checkpointing ({impl.replay_refusal})"
        if reason is None and not ledger.allows_auto(impl, today):
            reason = f"ledger entry {ledger.status(impl, today)}"
        if reason is None:
            entry = ledger.entry(impl)
            return impl, f"auto: available, approved in the ledger until {entry.expires}" + _against_bf16(ledger, impl)
        skipped.append(f"{impl.key}: {reason}")
    if not skipped:
        return op.portable, f"auto: no vendor implementation for {platform_of(device)}"
    return op.portable, "auto: " + "; ".join(skipped)


def _against_bf16(ledger: Ledger, impl: Implementation) -> str:
    """What a low-precision implementation's whole steps measured against bf16, where the ledger has them: an
    approval is against the op's emulation, and a reader of the reason must not take it for a speed-up."""
    entry = ledger.entry(impl)
    summary = entry.speed_summary() if entry is not None else None
    return "" if summary is None else f"; {summary}"
