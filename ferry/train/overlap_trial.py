"""`parallel.ep_overlap: auto`: the expert-parallel exchange the run trains with, chosen by measuring it here.

Whether overlapping the exchange with the experts' computation pays depends on the shape, the interconnect and
the kernels (OLMo-core found it sometimes slowed the step), so no setting is right everywhere. Before its first
step the run trains a few trial steps with each candidate (one exchange; 2 parts; 4 parts; rowwise), on the same data
from the same state, puts everything back (weights, router biases, AdamW moments, the loss scale, the data
position, the random generators), and keeps the fastest by the slowest rank's median step time. Every
candidate's figures and the choice go to run.json, so a slower overlap is never kept silently. The trial costs
`3 x (steps + 1)` steps of time and a copy of the weights and moments while it runs.
"""

from __future__ import annotations

import statistics
from typing import Protocol

import torch

from ferry.train.assembly import RunParts
from ferry.train.state import TrainState


class Trainer(Protocol):
    """What the trial needs of the trainer: its parts, its train state, and one step."""

    parts: RunParts
    state: TrainState

    def train_step(self) -> dict: ...


CANDIDATES = {"none": (1, False), "chunked2": (2, False), "chunked4": (4, False), "rowwise": (1, True)}


def choose_overlap(trainer: Trainer, steps: int) -> dict:
    """Measure each candidate for `steps` steps after one of warm-up, restore the run, keep the fastest."""
    model = trainer.parts.model
    dispatchers = [layer.dispatcher for layer in model.model.moe_layers() if layer.dispatcher is not None]
    if not dispatchers:
        return {"mode": "auto", "chosen": "none", "reason": "no expert-parallel exchange (parallel.ep 1)"}
    snapshot = _RunSnapshot(trainer)
    figures = {}
    for name, (chunks, rowwise) in CANDIDATES.items():
        for dispatcher in dispatchers:
            dispatcher.chunks, dispatcher.rowwise = chunks, rowwise
        records = [trainer.train_step() for _ in range(steps + 1)][1:]
        snapshot.restore(trainer)
        step_s = statistics.median(record["step_s"] for record in records)
        shares = [record["ep_overlap_share"] or 0.0 for record in records]
        figures[name] = {
            "step_s": step_s,
            "ep_overlap_share": statistics.median(shares),
            "ep_exchanges": statistics.median(record["ep_exchanges"] for record in records),
        }
    slowest = model.reductions.largest([figure["step_s"] for figure in figures.values()])
    for figure, step_s in zip(figures.values(), slowest):
        figure["step_s"] = step_s  # the slowest rank's: every rank then picks the same
    chosen = min(figures, key=lambda name: figures[name]["step_s"])
    chunks, rowwise = CANDIDATES[chosen]
    for dispatcher in dispatchers:
        dispatcher.chunks, dispatcher.rowwise = chunks, rowwise
    return {
        "mode": "auto",
        "chosen": chosen,
        "chunks": chunks,
        "dispatch": "rowwise" if rowwise else "permuted",
        "trial_steps": steps,
        "candidates": figures,
    }


class _RunSnapshot:
    """Everything a trial step changes, copied, and put back after each candidate."""

    def __init__(self, trainer: Trainer):
        parts = trainer.parts
        self.weights = {name: tensor.clone() for name, tensor in parts.model.model.state_dict().items()}
        self.moments = {
            param: {key: _copied(value) for key, value in state.items()}
            for param, state in parts.model.optimizer.state.items()
        }
        self.train_state = trainer.state
        self.scaler = parts.numerics.scaler.state_dict()
        self.objective = parts.objective.state()
        self.rng = torch.get_rng_state()

    def restore(self, trainer: Trainer) -> None:
        parts = trainer.parts
        parts.model.optimizer.zero_grad(set_to_none=True)
        parts.model.model.load_state_dict(self.weights)
        state = parts.model.optimizer.state
        state.clear()
        for param, entries in self.moments.items():
            state[param] = {key: _copied(value) for key, value in entries.items()}
        trainer.state = self.train_state
        parts.numerics.scaler.load_state_dict(self.scaler)
        parts.objective.load_state(self.objective)
        torch.set_rng_state(self.rng)
        parts.model.plan.stats.take()


def _copied(value):
    return value.clone() if isinstance(value, torch.Tensor) else value
