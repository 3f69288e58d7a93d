"""Optimizers as kinds (`optim.name`), one a file: AdamW (`adamw.py`) and Muon with AdamW (`muon.py`). Each answers
how it is built over a rank's parameters, what its checkpoint state is called, its memory terms and what it
refuses (`base.py`); a run builds one recipe (`registry.optimizer_recipe`) that every layout builds from."""

from ferry.parallel.optimizers.adamw import AdamWKind, adamw_recipe, fused_where_available
from ferry.parallel.optimizers.base import OptimizerKind, OptimizerMemory, OptimizerRecipe
from ferry.parallel.optimizers.muon import MuonConfig, MuonKind
from ferry.parallel.optimizers.registry import (
    DEFAULT_OPTIMIZER,
    OPTIMIZER_KINDS,
    optimizer_kind_of,
    optimizer_recipe,
)

__all__ = [
    "DEFAULT_OPTIMIZER",
    "OPTIMIZER_KINDS",
    "AdamWKind",
    "MuonConfig",
    "MuonKind",
    "OptimizerKind",
    "OptimizerMemory",
    "OptimizerRecipe",
    "adamw_recipe",
    "fused_where_available",
    "optimizer_kind_of",
    "optimizer_recipe",
]
