"""Kernel selection: which implementation of each op a run uses, and the portable path's budget."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from ferry.config.section import Section
from ferry.kernels.catalogue import REGISTRY


class KernelsConfig(Section):
    """`portable` runs pure PyTorch everywhere; `auto` also takes ledger-approved vendor kernels.

    `auto` picks, per op, the first vendor implementation that is available on the
    device and holds an approved, unexpired ledger entry, else the portable one.
    `ops` pins single ops (`portable` or an implementation name) over either policy.
    """

    policy: Literal["portable", "auto"] = "auto"
    ops: dict[str, str] = Field(
        default_factory=dict, description='per-op override, e.g. {"moe.grouped_mm": "portable"}'
    )
    overhead_budget: float = Field(
        0.10, ge=0.0, lt=1.0, description="throughput the portable path may lose before a vendor exception is due"
    )

    @field_validator("ops")
    @classmethod
    def _ops_exist(cls, ops: dict[str, str]) -> dict[str, str]:
        for op_name, impl_name in ops.items():
            if op_name not in REGISTRY:
                raise ValueError(f"unknown op {op_name!r}; ops are {', '.join(REGISTRY.names)}")
            if not REGISTRY[op_name].named(impl_name):
                known = sorted({impl.name for impl in REGISTRY[op_name].implementations})
                raise ValueError(f"{op_name} has no implementation {impl_name!r}; it has {', '.join(known)}")
        return ops
