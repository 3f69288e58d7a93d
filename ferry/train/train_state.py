"""The trainer's state in and out of checkpoints: what a save holds beside the tensors, resuming a run
where its checkpoint left it (in this run's layout), starting from another run's weights (`init_from`),
and the seed's weights for a resume that finds nothing to resume from. The tensors themselves go by
logical names (`ferry.train.checkpointing`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ferry.checkpoint import (
    Checkpoint,
    CheckpointMeta,
    Found,
    Layout,
    SharedVerification,
    TensorPiece,
    find_resume_point,
)
from ferry.comm import gather_objects
from ferry.config import UserError
from ferry.data import DataCursor
from ferry.model import Transformer
from ferry.model.digest import weights_digest
from ferry.train.checkpointing import (
    OPTIM,
    RNG,
    check_config,
    copy_into_piece,
    optimizer_prefetch,
    optimizer_record,
    restore_model,
    restore_optimizer,
    restore_rng,
    train_state_pieces,
)
from ferry.train.optimizer import learning_rate

if TYPE_CHECKING:
    from ferry.train.trainer import Trainer


def checkpoint_state(trainer: Trainer) -> tuple[dict[str, TensorPiece], CheckpointMeta]:
    """This rank's share of the train state under logical names, and the manifest's metadata."""
    config = trainer.config
    step = trainer.cursor.step
    pieces = train_state_pieces(trainer.model, trainer.optimizer, trainer.plan, trainer.device)
    train_state = {
        "data_cursor": trainer.cursor.to_dict(),
        "schedule": {
            "kind": f"warmup_{config.optim.schedule}",
            "step": step,
            "total_steps": config.train.steps,
            "warmup_steps": config.optim.warmup_steps,
            "next_lr": learning_rate(config.optim, step, config.train.steps),
            "last_lr": learning_rate(config.optim, step - 1, config.train.steps) if step else None,
        },
        "optimizer": optimizer_record(trainer.model, trainer.optimizer),
        "loss_scaler": {"kind": trainer.scaler.kind, **trainer.scaler.state_dict()},
        "precision": trainer.precision.as_dict(),
        "tokens_seen": trainer.tokens_seen,
        "objective": trainer.objective.state(),
        **({"tokenizer": {"encoding_sha256": trainer.tokenizer_digest}} if trainer.tokenizer_digest else {}),
    }
    meta = CheckpointMeta(
        step=step,
        tokens_seen=trainer.tokens_seen,
        layout=Layout(**trainer.layout()),
        model_config=config.model.model_dump(mode="json"),
        run_config=config.model_dump(mode="json"),
        environment=trainer.environment,
        train_state=train_state,
    )
    return pieces, meta


def restore(trainer: Trainer, checkpoint: Checkpoint) -> list[str]:
    """Continue from `checkpoint` in this run's layout: weights, optimizer state, scaler, RNG, data position.

    Returns notes for the user: config fields that differ from the checkpoint's
    (a different model is refused) and states that could not be carried over.
    """
    notes = [f"config differs from the checkpoint's: {line}" for line in check_config(checkpoint, trainer.config)]
    check_resumable(checkpoint)
    recorded = (checkpoint.manifest.train_state.get("tokenizer") or {}).get("encoding_sha256")
    if recorded and trainer.tokenizer_digest and recorded != trainer.tokenizer_digest:
        raise UserError(
            f"resume: {checkpoint.path} was trained on text tokenized otherwise than this run's data "
            f"({trainer.loader.datasets[0].label}: encoding digest {trainer.tokenizer_digest[:12]}, the checkpoint's "
            f"{recorded[:12]}); prepare the data with the run's tokenizer (ferry data prepare --tokenizer)"
        )
    with checkpoint:
        restore_model(checkpoint, trainer.model, trainer.plan)
        restore_optimizer(checkpoint, trainer.model, trainer.optimizer, trainer.plan)
        rng_notes = restore_rng(checkpoint, trainer.device, trainer.rank, trainer.world_size)
    notes += rng_notes
    state = checkpoint.manifest.train_state
    trainer.carried = {
        "weights": "carried",
        "optimizer": "carried (AdamW moments and step counts)",
        "data_cursor": "carried",
        "schedule": f"carried (continues at step {checkpoint.step} of {trainer.config.train.steps})",
        "rng": "carried" if not rng_notes else "not carried: " + "; ".join(rng_notes),
    }
    scaler = state.get("loss_scaler")
    if scaler and scaler["kind"] == trainer.scaler.kind:
        trainer.scaler.load_state_dict(scaler)
        trainer.carried["loss_scaler"] = "carried" if trainer.scaler.enabled else "carried (none in use)"
    elif trainer.scaler.enabled:
        note = f"loss scaling restarts from precision.loss_scaling.init_scale ({trainer.scaler.scale:g})"
        notes.append(note)
        trainer.carried["loss_scaler"] = note
    else:
        saved = scaler["kind"] if scaler else "absent"
        trainer.carried["loss_scaler"] = f"not in use here (the checkpoint's: {saved})"
    trainer.cursor = DataCursor.from_dict(state["data_cursor"])
    trainer.tokens_seen = int(state.get("tokens_seen", trainer.cursor.step * trainer.tokens_per_step))
    trainer.objective.load_state(state.get("objective"))
    return notes


def check_resumable(checkpoint: Checkpoint) -> None:
    """A resume continues a run, so it needs a run's whole state; weights alone (what `ferry import` and
    `ferry ckpt average` write) start a run instead, and the message says how."""
    state = checkpoint.manifest.train_state
    has_optimizer = isinstance(state.get("optimizer"), dict) and bool(checkpoint.names(OPTIM))
    missing = [
        what
        for what, present in (
            ("AdamW state", has_optimizer),
            ("data position", isinstance(state.get("data_cursor"), dict)),
            ("RNG state", RNG + "cpu" in checkpoint.manifest.tensors),
        )
        if not present
    ]
    if missing:
        start = f"init_from={checkpoint.path}" + (" init_optimizer=true" if has_optimizer else "")
        raise UserError(
            f"resume: {checkpoint.path} holds no {', '.join(missing)}: it holds weights to start a run from, not "
            f"a run to continue (as `ferry import` and `ferry ckpt average` write them); start from it with {start}"
        )


def initialize_from(trainer: Trainer, path: Path) -> list[str]:
    """Start from the weights of the checkpoint at `path` (of the same model), and its AdamW state with
    `init_optimizer`; data position, step counter and schedule start fresh."""
    digests = (trainer.config.checkpoint.verify,)
    if not path.exists():
        raise UserError(f"init_from: {str(path)!r} does not exist")
    checkpoint = find_resume_point(str(path), path, share=shared_verification(trainer), digests=digests).checkpoint
    check_config(checkpoint, trainer.config)
    with_optimizer = trainer.config.init_optimizer
    if with_optimizer and not ("optimizer" in checkpoint.manifest.train_state and checkpoint.names("optim.")):
        raise UserError(f"init_optimizer: {checkpoint.path} holds no optimizer state (weights only)")
    with checkpoint:
        restore_model(checkpoint, trainer.model, trainer.plan)
        if with_optimizer:
            restore_optimizer(checkpoint, trainer.model, trainer.optimizer, trainer.plan)
    optimizer = f"from {checkpoint.path}" if with_optimizer else "fresh"
    weights = f"from {checkpoint.path} (step {checkpoint.step})"
    trainer.carried = {"weights": weights, "optimizer": optimizer, "schedule": "fresh"}
    state = "weights and optimizer state" if with_optimizer else "weights"
    fresh = "data position and schedule" if with_optimizer else "optimizer, data position and schedule"
    return [f"{state} initialised from {checkpoint.path} (step {checkpoint.step}); {fresh} start fresh"]


def resume_from(trainer: Trainer, resume: str | None) -> tuple[Found | None, list[str], dict[str, float]]:
    """Restore the checkpoint `resume` points to, if any; None when the run does not resume.

    Also returns the seconds spent verifying and restoring it: the part of a move's
    switching lead time that the checkpoint itself costs.
    """
    config = trainer.config
    if resume is None:
        return None, [], {}
    started = time.perf_counter()
    prefetch = optimizer_prefetch(trainer.model, trainer.optimizer, trainer.plan)
    found = find_resume_point(
        resume,
        config.checkpoint.path(config.run.path),
        prefetch,
        shared_verification(trainer),
        digests=(config.checkpoint.verify,),
    )
    verified = time.perf_counter()
    notes = restore(trainer, found.checkpoint) if found.checkpoint else []
    return found, notes, {"verify_s": verified - started, "restore_s": time.perf_counter() - verified}


def shared_verification(trainer: Trainer) -> SharedVerification | None:
    """In a multi-rank job the ranks split the hashing of a checkpoint's files and agree on the verdict."""
    if not trainer.context.is_distributed:
        return None

    return SharedVerification(trainer.rank, trainer.world_size, partial(gather_objects, trainer.context))


def draw_deferred_weights(trainer: Trainer, progress: Callable[[], None]) -> str | None:
    """Give a run that resumed from nothing the weights a run from scratch starts from; return their digest
    (main rank only, else None).

    A run asked to resume builds its model without drawing it: a checkpoint, once found, replaces every
    weight, and at billions of parameters the host's draw takes minutes, paid on every restart. Only when
    no checkpoint is found are the weights drawn, here, after the model was laid out over the ranks: the
    whole model on the host from the run's seed, exactly as a run from scratch builds it (the generator
    ends where that run's does), and each rank copies its piece of every tensor (the layout-neutral load
    path of a checkpoint). `progress` is called as each parameter is drawn and once they are all in place.
    """
    config = trainer.config
    torch.default_generator.manual_seed(config.run.seed)
    drawn = Transformer(config.model, trainer.kernels, initialise=False)  # the constructors draw too, as in any build
    drawn.reset_parameters(progress)
    targets = trainer.model.state_dict()
    for name, whole in drawn.state_dict().items():
        copy_into_piece(targets, name, whole, trainer.plan)
    progress()
    return weights_digest(drawn) if trainer.is_main else None
