"""`ferry ckpt average`: weight averaging ("model soups", Wortsman et al. 2022) of checkpoints of one model.

Averaging the weights of checkpoints along one run (or of runs fine-tuned from one
parent) lands in a flatter region of the loss than either end point; the result is
a checkpoint like any other, so a later stage starts from it with `init_from`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from ferry.checkpoint.diff import config_differences
from ferry.checkpoint.format import Layout, TensorPiece, optimizer_kind
from ferry.checkpoint.reader import Checkpoint, verify_checkpoint
from ferry.checkpoint.writer import CheckpointMeta, save_checkpoint
from ferry.config import UserError

MODEL, OPTIM, STEP_COUNT = "model.", "optim.", "optim.step."
OptimizerChoice = Literal["drop", "average"]


@dataclass(frozen=True)
class AverageResult:
    path: Path
    weights: list[float]
    tensors: int
    optimizer: OptimizerChoice


def average_checkpoints(
    paths: list[str | Path],
    out: str | Path,
    weights: list[float] | None = None,
    optimizer: OptimizerChoice = "drop",
) -> AverageResult:
    """The weighted mean (weights normalised to sum to one) of every model tensor, computed in float64
    and stored in each tensor's dtype; with `optimizer="average"`, the optimizer's state too (AdamW's moments,
    Muon's momentum: every state of the kind the manifests record, which must be one), and its step counts the
    largest of the inputs'. The RNG state is dropped: the result starts a stage."""
    if len(paths) < 2:
        raise UserError("ckpt average: give at least two checkpoints")
    weights = weights if weights is not None else [1.0] * len(paths)
    if len(weights) != len(paths) or any(not math.isfinite(weight) or weight <= 0 for weight in weights):
        raise UserError(f"--weights: {len(paths)} positive numbers, one per checkpoint (got {weights})")
    total = sum(weights)
    weights = [weight / total for weight in weights]
    checkpoints = [verify_checkpoint(Path(path)) for path in paths]
    first = checkpoints[0]
    names = _names(first, optimizer)
    for other in checkpoints[1:]:
        if optimizer == "average":
            _check_same_optimizer(first, other)
        _check_same_model(first, other, names)
    pieces = {}
    for name in names:
        if name.startswith(STEP_COUNT):
            pieces[name] = TensorPiece.whole(torch.stack([c.read(name) for c in checkpoints]).amax(dim=0))
            continue
        mean = sum(weight * c.read(name).double() for weight, c in zip(weights, checkpoints))
        pieces[name] = TensorPiece.whole(mean.to(getattr(torch, first.record(name).dtype)).contiguous())
    latest = max(checkpoints, key=lambda c: c.step)
    meta = CheckpointMeta(
        step=latest.step,
        tokens_seen=latest.manifest.tokens_seen,
        layout=Layout(world_size=1, ep_degree=1, mode="single"),
        model_config=first.manifest.model,
        run_config=first.manifest.run_config,
        environment=first.manifest.environment,
        train_state={
            "averaged": {
                "from": [str(c.path) for c in checkpoints],
                "weights": weights,
                "optimizer": "moments averaged, largest step count" if optimizer == "average" else "dropped",
            },
            **({"optimizer": first.manifest.train_state["optimizer"]} if optimizer == "average" else {}),
        },
    )
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"ckpt average: {out} exists and is not empty")
    path = save_checkpoint(out, pieces, meta)
    return AverageResult(path, weights, len(pieces), optimizer)


def _names(checkpoint: Checkpoint, optimizer: OptimizerChoice) -> list[str]:
    names = checkpoint.names(MODEL)
    if optimizer == "average":
        moments = checkpoint.names(OPTIM)
        if not moments or optimizer_kind(checkpoint.manifest.train_state) is None:
            raise UserError(
                f"--optimizer average: {checkpoint.path} holds no optimizer state (a weights-only checkpoint)"
            )
        names += moments
    return names


def _check_same_optimizer(first: Checkpoint, other: Checkpoint) -> None:
    ours, theirs = optimizer_kind(first.manifest.train_state), optimizer_kind(other.manifest.train_state)
    if ours != theirs:
        raise UserError(
            f"ckpt average --optimizer average: {other.path} holds {theirs or 'no'} optimizer state and {first.path} "
            f"{ours}'s; their states cannot be averaged (drop them with --optimizer drop)"
        )


def _check_same_model(first: Checkpoint, other: Checkpoint, names: list[str]) -> None:
    differences = config_differences(first.manifest.model, other.manifest.model, "model.")
    if differences:
        raise UserError(
            f"ckpt average: {other.path} is of another model than {first.path}: "
            + "; ".join(str(difference) for difference in differences)
        )
    missing = sorted(set(names) - set(other.manifest.tensors))
    if missing:
        raise UserError(f"ckpt average: {other.path} lacks {len(missing)} tensor(s) of {first.path}, e.g. {missing[0]}")
    for name in names:
        ours, theirs = first.record(name), other.record(name)
        if ours.shape != theirs.shape:
            raise UserError(f"ckpt average: {name} is {theirs.shape} in {other.path} but {ours.shape} in {first.path}")
