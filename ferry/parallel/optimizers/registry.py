"""The optimizer kinds by the config literal that names them (`optim.name`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ferry.parallel.optimizers.adamw import AdamWKind
from ferry.parallel.optimizers.base import OptimizerKind, OptimizerRecipe
from ferry.parallel.optimizers.muon import MuonKind

OPTIMIZER_KINDS: dict[str, OptimizerKind] = {kind.name: kind for kind in (AdamWKind(), MuonKind())}
DEFAULT_OPTIMIZER = AdamWKind.name


def optimizer_recipe(optim: Any, model: nn.Module, decayed: set[str]) -> OptimizerRecipe:
    """The recipe of the run's `optim` section (`ferry.train.config.OptimConfig`) over the whole `model`, before it
    is laid out; `decayed` names the parameters with weight decay."""
    kind = OPTIMIZER_KINDS[optim.name]
    hyperparameters = {"lr": optim.lr, "betas": tuple(optim.betas), "eps": optim.eps}
    return OptimizerRecipe(kind, frozenset(decayed), optim.weight_decay, hyperparameters, kind.settings(optim, model))


def optimizer_kind_of(state_kind: str | None) -> OptimizerKind | None:
    """The kind whose checkpoint state is called `state_kind` (a manifest's `train_state.optimizer.kind`)."""
    return next((kind for kind in OPTIMIZER_KINDS.values() if kind.state_kind == state_kind), None)
