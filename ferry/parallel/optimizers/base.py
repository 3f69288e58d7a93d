"""What an optimizer kind answers (`optim.name`; `ferry/parallel/optimizers/`), so that nothing else compares an
optimizer's name: how it is built over a rank's parameters (whatever the layout hands it: whole parameters, a ZeRO
owner's slices, FSDP's shards), what its checkpoint state is called, what it holds in memory, and which settings it
refuses with the rest of the run.

A run builds one `OptimizerRecipe` from the config and the whole model (before it is laid out); every layout then
builds its optimizer from the recipe over the parameters it holds. The recipe is the one thing handed down, so a
kind's settings never travel through the layouts' signatures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import nn

from ferry.config.refusals import Refusal

if TYPE_CHECKING:
    from ferry.comm import Collectives

Params = list[tuple[str, nn.Parameter]]


@dataclass(frozen=True)
class OptimizerMemory:
    """An optimizer's memory per parameter, for the memory model: the share of the parameters AdamW steps (two fp32
    moments each; the rest keep one buffer in the parameter dtype) and the bytes of its largest working set beyond
    its state (0 for an elementwise optimizer)."""

    adamw_share: float
    working_bytes: float


class OptimizerKind(Protocol):
    """One optimizer (`optim.name`)."""

    name: ClassVar[str]  # the config literal
    state_kind: ClassVar[str]  # what a checkpoint's manifest records of its state (`train_state.optimizer.kind`)
    state_held: ClassVar[str]  # what its state holds besides the parameters, in the memory model's words
    state_carried: ClassVar[str]  # what a resume carries of it, in run.json's words

    def settings(self, optim: Any, model: nn.Module) -> Any:
        """What the kind takes of the run's `optim` section and of the whole `model` (before it is laid out), for
        the recipe; None when it needs nothing."""

    def build(self, recipe: OptimizerRecipe, params: Params, shard_owners: Collectives | None) -> torch.optim.Optimizer:
        """The optimizer over `params` (whole, a ZeRO owner's slices, or FSDP's shards, whose whole-matrix work is
        shared among the ranks of `shard_owners`)."""

    def refusals(self, config: Any) -> list[Refusal]:
        """What the run config (`ferry.train.config.RunConfig`) asks of this kind that it cannot do with the rest of
        the run, whether or not the run chose it (a setting of its own given to a run of another optimizer); each
        names the setting to change."""

    def memory(
        self,
        config: Any,
        params: int,
        expert_params: int,
        param_bytes: int,
        experts_split_over: int,
        weights_sharded_over: int,
    ) -> OptimizerMemory:
        """Its memory terms for a rank's share of the model, `params` parameters of which `expert_params` are
        experts' (before any split), in `param_bytes` each; the experts split over `experts_split_over` ranks and
        the weights sharded over `weights_sharded_over` (FSDP; 1 when each rank holds its matrices whole)."""


@dataclass(frozen=True)
class OptimizerRecipe:
    """What every rank builds its optimizer from: the kind, which parameters decay and by how much, AdamW's
    hyperparameters (`lr`, `betas`, `eps`: every kind's AdamW part takes them) and the kind's own settings."""

    kind: OptimizerKind
    decayed: frozenset[str]
    weight_decay: float
    hyperparameters: dict = field(default_factory=dict)
    settings: Any = None

    def over(self, params: Params, shard_owners: Collectives | None = None) -> torch.optim.Optimizer:
        return self.kind.build(self, params, shard_owners)
