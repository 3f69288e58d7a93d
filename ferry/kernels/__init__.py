"""Kernels: the op registry, its portable and vendor implementations, the debt ledger.

Model code asks a `KernelSelection` for an op's function and never imports an
implementation; `select_kernels` makes that choice once per run from `KernelsConfig`.
"""

from ferry.kernels.catalogue import REGISTRY
from ferry.kernels.config import KernelsConfig
from ferry.kernels.dispatch import Dispatch
from ferry.kernels.ledger import Ledger, LedgerEntry, load_ledger
from ferry.kernels.registry import Implementation, Op, Registry, platform_of
from ferry.kernels.selection import KernelSelection, portable_kernels, select_kernels

__all__ = [
    "REGISTRY",
    "Dispatch",
    "Implementation",
    "KernelSelection",
    "KernelsConfig",
    "Ledger",
    "LedgerEntry",
    "Op",
    "Registry",
    "load_ledger",
    "platform_of",
    "portable_kernels",
    "select_kernels",
]
