"""Collective backend configuration."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ferry.config.section import Section


class CommConfig(Section):
    """`auto` takes nccl on CUDA and ROCm builds (RCCL answers to the nccl name), xccl on XPU, gloo on CPU."""

    backend: Literal["auto", "gloo", "nccl", "mpi", "xccl"] = "auto"
    timeout_s: int = Field(300, ge=1, description="a collective that waits longer fails on every rank")
