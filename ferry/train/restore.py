"""The train state in and out of checkpoints: what a save holds beside the tensors, resuming a run
where its checkpoint left it (in this run's layout), starting from another run's weights (`init_from`),
and the seed's weights for a resume that finds nothing to resume from. The tensors themselves go by
logical names (`ferry.train.checkpointing`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ferry.checkpoint import (
    Checkpoint,
    CheckpointMeta,
    Found,
    Layout,
    TensorPiece,
    find_resume_point,
)
from ferry.config import UserError
from ferry.model import Transformer
from ferry.model.digest import weights_digest
from ferry.train.checkpointing import (
    CONVERSIONS,
    OPTIM,
    RNG,
    check_config,
    copy_into_piece,
    optimizer_record,
    restore_model,
    restore_optimizer,
    restore_rng,
    resume_prefetch,
    shared_verification,
    train_state_pieces,
)
from ferry.train.optimizer import learning_rate
from ferry.train.state import TrainState

# what a resume carries of each optimizer's state
if TYPE_CHECKING:
    from ferry.kernels import KernelSelection
    from ferry.train.assembly import Job, ModelParts, Numerics, RunData
    from ferry.train.objectives.base import Objective


def checkpoint_state(
    job: Job,
    numerics: Numerics,
    model: ModelParts,
    data: RunData,
    objective: Objective,
    environment: dict,
    state: TrainState,
) -> tuple[dict[str, TensorPiece], CheckpointMeta]:
    """This rank's share of the train state under logical names, and the manifest's metadata."""
    config = job.config
    step = state.step
    pieces = train_state_pieces(model.model, model.optimizer, model.plan, job.device)
    digest = data.tokenizer_digest
    train_state = {
        "data_cursor": state.state_dict()["data_cursor"],
        "schedule": {
            "kind": f"warmup_{config.optim.schedule}",
            "step": step,
            "total_steps": config.train.steps,
            "warmup_steps": config.optim.warmup_steps,
            "next_lr": learning_rate(config.optim, step, config.train.steps),
            "last_lr": learning_rate(config.optim, step - 1, config.train.steps) if step else None,
        },
        "optimizer": optimizer_record(model.model, model.optimizer, model.recipe.kind),
        "loss_scaler": {"kind": numerics.scaler.kind, **numerics.scaler.state_dict()},
        "precision": numerics.precision.as_dict(),
        "tokens_seen": state.tokens_seen,
        "objective": objective.state(),
        **({"tokenizer": {"encoding_sha256": digest}} if digest else {}),
    }
    meta = CheckpointMeta(
        step=step,
        tokens_seen=state.tokens_seen,
        layout=Layout(**{key: value for key, value in job.layout.record().items() if key in Layout.model_fields}),
        model_config=config.model.model_dump(mode="json"),
        run_config=config.model_dump(mode="json"),
        environment=environment,
        train_state=train_state,
    )
    return pieces, meta


def restore(
    job: Job,
    numerics: Numerics,
    model: ModelParts,
    data: RunData,
    objective: Objective,
    tokens_per_step: int,
    checkpoint: Checkpoint,
    state: TrainState,
) -> tuple[TrainState, list[str]]:
    """Continue from `checkpoint` in this run's layout: weights, optimizer state, scaler, RNG, data position.

    Returns the state the checkpoint describes, with what came over, and notes for the user: config fields that
    differ from the checkpoint's (a different model is refused) and states that could not be carried over.
    """
    config = job.config
    notes = [f"config differs from the checkpoint's: {line}" for line in check_config(checkpoint, config)]
    check_resumable(checkpoint)
    recorded = (checkpoint.manifest.train_state.get("tokenizer") or {}).get("encoding_sha256")
    digest = data.tokenizer_digest
    if recorded and digest and recorded != digest:
        raise UserError(
            f"resume: {checkpoint.path} was trained on text tokenized otherwise than this run's data "
            f"({data.loader.datasets[0].label}: encoding digest {digest[:12]}, the checkpoint's "
            f"{recorded[:12]}); prepare the data with the run's tokenizer (ferry data prepare --tokenizer)"
        )
    with checkpoint:
        restore_model(checkpoint, model.model, model.plan)
        restore_optimizer(checkpoint, model.model, model.optimizer, model.plan, model.recipe.kind)
        rng_notes = restore_rng(checkpoint, job.device, job.rank, job.world_size)
    notes += rng_notes
    saved = checkpoint.manifest.train_state
    carried = {
        "weights": "carried",
        "optimizer": f"carried ({model.recipe.kind.state_carried})",
        "data_cursor": "carried",
        "schedule": f"carried (continues at step {checkpoint.step} of {config.train.steps})",
        "rng": "carried" if not rng_notes else "not carried: " + "; ".join(rng_notes),
    }
    scaler = numerics.scaler
    saved_scaler = saved.get("loss_scaler")
    if saved_scaler and saved_scaler["kind"] == scaler.kind:
        scaler.load_state_dict(saved_scaler)
        carried["loss_scaler"] = "carried" if scaler.enabled else "carried (none in use)"
    elif scaler.enabled:
        note = f"loss scaling restarts from precision.loss_scaling.init_scale ({scaler.scale:g})"
        notes.append(note)
        carried["loss_scaler"] = note
    else:
        kind = saved_scaler["kind"] if saved_scaler else "absent"
        carried["loss_scaler"] = f"not in use here (the checkpoint's: {kind})"
    restored = state.load_state_dict(saved, tokens_per_step).with_carried(carried)
    objective.load_state(saved.get("objective"))
    return restored, notes


def check_resumable(checkpoint: Checkpoint) -> None:
    """A resume continues a run, so it needs a run's whole state; weights alone (what `ferry import` and
    `ferry ckpt average` write) start a run instead, and the message says how."""
    state = checkpoint.manifest.train_state
    has_optimizer = isinstance(state.get("optimizer"), dict) and bool(checkpoint.names(OPTIM))
    missing = [
        what
        for what, present in (
            ("optimizer state", has_optimizer),
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


def initialize_from(job: Job, model: ModelParts, path: Path) -> tuple[dict[str, str], list[str]]:
    """Start from the weights of the checkpoint at `path` (of the same model), and its optimizer state with
    `init_optimizer`; data position, step counter and schedule start fresh. Returns what came over and a note."""
    config = job.config
    if not path.exists():
        raise UserError(f"init_from: {str(path)!r} does not exist")
    share = shared_verification(job.context)
    checkpoint = find_resume_point(str(path), path, share=share, digests=(config.checkpoint.verify,)).checkpoint
    conversions = [line for line in check_config(checkpoint, config) if line in CONVERSIONS.values()]
    with_optimizer = config.init_optimizer
    if with_optimizer and not ("optimizer" in checkpoint.manifest.train_state and checkpoint.names("optim.")):
        raise UserError(f"init_optimizer: {checkpoint.path} holds no optimizer state (weights only)")
    with checkpoint:
        restore_model(checkpoint, model.model, model.plan)
        if with_optimizer:
            restore_optimizer(checkpoint, model.model, model.optimizer, model.plan, model.recipe.kind)
    optimizer = f"from {checkpoint.path}" if with_optimizer else "fresh"
    weights = f"from {checkpoint.path} (step {checkpoint.step})"
    carried = {"weights": weights, "optimizer": optimizer, "schedule": "fresh"}
    what = "weights and optimizer state" if with_optimizer else "weights"
    fresh = "data position and schedule" if with_optimizer else "optimizer, data position and schedule"
    return carried, [
        f"{what} initialised from {checkpoint.path} (step {checkpoint.step}); {fresh} start fresh",
        *conversions,
    ]


def resume_from(
    job: Job,
    model: ModelParts,
    resume: str | None,
    state: TrainState,
    restore_found: Callable[[Checkpoint, TrainState], tuple[TrainState, list[str]]],
) -> tuple[Found | None, TrainState, list[str], dict[str, float]]:
    """Restore the checkpoint `resume` points to, if any (found None: the run does not resume), by
    `restore_found` (`restore` given the run's records); the state it describes (`state` itself when nothing
    was restored) and the notes.

    Also returns the seconds spent verifying and restoring it: the part of a move's
    switching lead time that the checkpoint itself costs.
    """
    config = job.config
    if resume is None:
        return None, state, [], {}
    started = time.perf_counter()
    prefetch = resume_prefetch(model.model, model.optimizer, model.plan)
    found = find_resume_point(
        resume,
        config.checkpoint.path(config.run.path),
        prefetch,
        shared_verification(job.context),
        digests=(config.checkpoint.verify,),
    )
    verified = time.perf_counter()
    notes: list[str] = []
    if found.checkpoint:
        state, notes = restore_found(found.checkpoint, state)
    return found, state, notes, {"verify_s": verified - started, "restore_s": time.perf_counter() - verified}


def draw_deferred_weights(
    job: Job, kernels: KernelSelection, model: ModelParts, progress: Callable[[], None]
) -> str | None:
    """Give a run that resumed from nothing the weights a run from scratch starts from; return their digest
    (main rank only, else None).

    A run asked to resume builds its model without drawing it: a checkpoint, once found, replaces every
    weight, and at billions of parameters the host's draw takes minutes, paid on every restart. Only when
    no checkpoint is found are the weights drawn, here, after the model was laid out over the ranks: the
    whole model on the host from the run's seed, exactly as a run from scratch builds it (the generator
    ends where that run's does), and each rank copies its piece of every tensor (the layout-neutral load
    path of a checkpoint). `progress` is called as each parameter is drawn and once they are all in place.
    """
    config = job.config
    torch.default_generator.manual_seed(config.run.seed)
    drawn = Transformer(config.model, kernels, initialise=False)  # its constructors draw too
    drawn.reset_parameters(progress)
    targets = model.model.state_dict()
    for name, whole in drawn.state_dict().items():
        copy_into_piece(targets, name, whole, model.plan)
    progress()
    return weights_digest(drawn) if job.is_main else None
