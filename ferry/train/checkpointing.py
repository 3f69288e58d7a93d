"""The trainer's state under logical checkpoint names, and back into a model, optimizer and RNG,
whatever the parallel layout on either side.

Names (docs/checkpoint-format.md), all independent of world size, device and precision:

  model.<state_dict key>          every parameter and persistent buffer (routers' expert_bias_E too)
  optim.<state key>.<param name>  AdamW `exp_avg`, `exp_avg_sq` and `step`, or Muon's `momentum_buffer`, of
                                  parameter model.<param name>
  rng.cpu, rng.<device type>      generator states, one row per rank: [world_size, state bytes]

A rank contributes the pieces it is responsible for: expert slices (EP), FSDP shards,
ZeRO-owned optimizer moments, and replicated tensors from one rank only. Loading reads
exactly the slice each local tensor covers, so a checkpoint saved in any layout loads
into any other. The rest (data cursor, schedule position, loss scaler, optimizer
groups) is JSON in the manifest's `train_state`.
"""

from __future__ import annotations

from functools import partial

import torch
from pydantic import ValidationError
from torch import nn

from ferry.checkpoint import (
    Checkpoint,
    CheckpointError,
    Difference,
    Manifest,
    Prefetch,
    SharedVerification,
    TensorPiece,
    config_differences,
)
from ferry.comm import DistContext, gather_objects
from ferry.config import ConfigError
from ferry.model import ModelConfig
from ferry.model.variants import SKIP_KINDS
from ferry.parallel import ParallelPlan
from ferry.parallel.optimizers import OptimizerKind
from ferry.parallel.zero import stepped_names
from ferry.train.config import RunConfig
from ferry.train.optimizer import decayed_parameter_names

MODEL = "model."
OPTIM = "optim."
RNG = "rng."

# Keys that say where and how a run is recorded, not what it computes: a resume may change them freely.
_BOOKKEEPING = ("run.name", "run.dir", "run.overwrite", "resume", "checkpoint.", "train.stop_at")


def train_state_pieces(model: nn.Module, optimizer, plan: ParallelPlan, device: torch.device) -> dict[str, TensorPiece]:
    """This rank's share of the train state, each piece placed in its global tensor."""
    rank, world_size = plan.context.rank, plan.context.world_size
    pieces = {}
    for name, tensor in model.state_dict().items():
        if plan.writes(name, tensor):
            pieces[MODEL + name] = plan.piece(name, tensor)
    for holder in plan.state_holders(model, optimizer):
        state = optimizer.state.get(holder.tensor)
        if not state or not holder.writes:
            continue
        for key, value in state.items():
            if value.ndim == 0:
                if not any(holder.piece.offset):  # a step count is the same everywhere: element 0's holder writes it
                    pieces[f"{OPTIM}{key}.{holder.name}"] = TensorPiece.whole(value)
            else:
                pieces[f"{OPTIM}{key}.{holder.name}"] = _placed_like(value, holder.piece, plan)
    pieces[RNG + "cpu"] = _rank_row(torch.get_rng_state(), rank, world_size)
    if device.type != "cpu":
        state = torch.get_device_module(device.type).get_rng_state(device)
        pieces[RNG + device.type] = _rank_row(state, rank, world_size)
    return pieces


def optimizer_record(model: nn.Module, optimizer, kind: OptimizerKind) -> dict:
    """The optimizer's kind and parameter groups by parameter name, over the whole model (all ranks)."""
    names = stepped_names(optimizer, model)
    groups = []
    for group in optimizer.param_groups:
        hyperparameters = {key: value for key, value in group.items() if key != "params"}
        groups.append({**hyperparameters, "params": [names[param] for param in group["params"]]})
    return {
        "kind": kind.state_kind,
        "decayed": sorted(decayed_parameter_names(model)),
        "param_groups_on_rank_0": groups,
    }


# Model fields that change no weight: a long-context stage sets them over its parent's checkpoint.
POSITIONAL_FIELDS = ("model.max_seq_len", "model.rope_theta", "model.rope_scaling.")
# How a model is trained, not what it computes: the initial draw (which a checkpoint replaces) and the weights
# of the routers' losses and the bias balancing's step (a transformers config has no place for them, so a
# model imported from one comes back with the defaults).
TRAINING_FIELDS = (
    "model.init_std",
    "model.moe.aux_loss_coef",
    "model.moe.z_loss_coef",
    "model.moe.bias_balancing.update_rate",
)


# Checkpoints of one variant that another may continue, with what to say: each skip kind names the kinds it may
# start from (FarSkip from a standard model: another function from the first step on, as the FarSkip paper
# converts trained models before distilling them).
CONVERSIONS = {
    ("model.skip", source, kind.name): message
    for kind in SKIP_KINDS.values()
    for source, message in kind.converts_from.items()
}


def check_config(checkpoint: Checkpoint, config: RunConfig) -> list[str]:
    """Refuse a checkpoint of another model, naming each differing field; list the other differences.

    A different model would not fit the stored tensors or would silently compute
    something else. Other sections (optimizer, schedule, data, device, layout), the
    positional fields of the model (length, RoPE base and scaling) and the fields that only say how it
    is trained may change on purpose, as in a migration or a new stage; they are reported, not refused,
    as is the width of dense layers that neither side has.
    """
    current = config.model_dump(mode="json")
    saved = _with_defaults(checkpoint.manifest.model)
    model = config_differences(saved, current["model"], "model.")
    if saved.get("dense_layers") == current["model"]["dense_layers"] == 0:
        model = [difference for difference in model if difference.key != "model.dense_ffn_dim"]
    kept = POSITIONAL_FIELDS + TRAINING_FIELDS
    converted = [CONVERSIONS[_key(difference)] for difference in model if _key(difference) in CONVERSIONS]
    refused = [
        difference
        for difference in model
        if not difference.key.startswith(kept) and _key(difference) not in CONVERSIONS
    ]
    if refused:
        raise ConfigError(
            f"checkpoint {checkpoint.path} was saved from another model; differing fields:\n  "
            + "\n  ".join(str(difference) for difference in refused)
        )
    saved = {key: value for key, value in checkpoint.manifest.run_config.items() if key != "model"}
    rest = config_differences(saved, {key: value for key, value in current.items() if key != "model"})
    model = [difference for difference in model if _key(difference) not in CONVERSIONS]
    return converted + [str(difference) for difference in model + rest if not difference.key.startswith(_BOOKKEEPING)]


def _key(difference: Difference) -> tuple:
    return (difference.key, difference.saved, difference.current)


def _with_defaults(saved: dict) -> dict:
    """The saved model config with the default of every field added since: a checkpoint written before a
    field existed computed what that field's default computes (a config that no longer validates is
    compared as it is, so each of its differences is named)."""
    try:
        return ModelConfig.model_validate(saved).model_dump(mode="json")
    except ValidationError:
        return saved


def restore_model(checkpoint: Checkpoint, model: nn.Module, plan: ParallelPlan) -> None:
    targets = model.state_dict()
    stored = {name.removeprefix(MODEL) for name in checkpoint.names(MODEL)}
    whole = plan.logical_names  # the whole model's: a pipeline stage holds part, the checkpoint all
    if stored != whole:
        missing, unexpected = sorted(whole - stored), sorted(stored - whole)
        raise CheckpointError(
            f"{checkpoint.path} does not fit this model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    with torch.no_grad():
        boxes = [
            _box(checkpoint, MODEL + name, plan.piece(name, tensor))
            for name, tensor in targets.items()
            if not _same_memory(checkpoint.prefetched(MODEL + name), tensor)  # read in place while it was hashed
        ]
        checkpoint.read_many(boxes)


def restore_optimizer(
    checkpoint: Checkpoint, model: nn.Module, optimizer, plan: ParallelPlan, kind: OptimizerKind
) -> None:
    """Load the stored moments and steps of the parameters this rank's optimizer holds.

    State is matched to parameters by name, so it loads whatever the layout (ZeRO
    owners, EP slices, FSDP shards); hyperparameters stay those of this run's config.
    """
    saved = checkpoint.manifest.train_state["optimizer"]
    if saved.get("kind") != kind.state_kind:
        raise CheckpointError(
            f"{checkpoint.path}: holds {saved.get('kind')} state and this run trains with {kind.state_kind} "
            f"(optim.name {kind.name}): a run continues with the optimizer it saved; to change optimizer, start from "
            f"the checkpoint's weights alone: init_from={checkpoint.path} init_optimizer=false"
        )
    stored: dict[str, list[str]] = {}
    for logical in checkpoint.names(OPTIM):
        key, _, name = logical.removeprefix(OPTIM).partition(".")
        if name not in plan.logical_params:  # a parameter of the whole model (another stage's, under a pipeline)
            raise CheckpointError(f"{checkpoint.path}: {logical} belongs to no parameter of this model")
        stored.setdefault(name, []).append(key)
    state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
    boxes = []
    for holder in plan.state_holders(model, optimizer):
        tensor = holder.tensor
        for key in stored.get(holder.name, []):
            logical = f"{OPTIM}{key}.{holder.name}"
            value = checkpoint.prefetched(logical)
            if key == "step":
                value = checkpoint.read(logical)
            elif not _adoptable(value, tensor, holder.piece, plan):
                value = torch.empty_like(tensor, memory_format=torch.contiguous_format)  # filled whole below
                boxes.append(_box(checkpoint, logical, _placed_like(value, holder.piece, plan)))
            state.setdefault(tensor, {})[key] = value
    checkpoint.read_many(boxes)
    optimizer.state.clear()
    optimizer.state.update(state)


def resume_prefetch(model: nn.Module, optimizer, plan: ParallelPlan) -> Prefetch:
    """What the verification of a checkpoint a run resumes from may read in place as it hashes each file: the
    optimizer's fresh moments (`optimizer_prefetch`) and the model's own weights and buffers held whole on this
    rank's CPU, so that every byte of those files is read from the disk once.

    The weights themselves may be written before the whole checkpoint is known to be valid: a run that
    resumes builds its model without drawing it (`draw_deferred_weights`), and a checkpoint that fails its
    check is followed by an older one, or by the drawn weights, each of which replaces every weight."""
    moments = optimizer_prefetch(model, optimizer, plan)
    whole_on_cpu = {
        MODEL + name: tensor
        for name, tensor in model.state_dict().items()
        if plan.held_whole(tensor, plan.piece(name, tensor)) and tensor.device.type == "cpu"
    }

    def in_place(manifest: Manifest) -> dict[str, torch.Tensor]:
        return {**moments(manifest), **whole_on_cpu}

    return in_place


def optimizer_prefetch(model: nn.Module, optimizer, plan: ParallelPlan) -> Prefetch:
    """What the verification of a checkpoint may read straight into fresh optimizer state for this rank.

    Moments of parameters this rank holds whole on the CPU, in the parameter's dtype:
    `restore_optimizer` then adopts them as they are, and their bytes are read once.
    """
    whole_on_cpu = {
        holder.name: holder.tensor
        for holder in plan.state_holders(model, optimizer)
        if plan.held_whole(holder.tensor, holder.piece) and holder.tensor.device.type == "cpu"
    }

    def fresh_moments(manifest: Manifest) -> dict[str, torch.Tensor]:
        moments = {}
        for logical, record in manifest.tensors.items():
            key, _, name = logical.removeprefix(OPTIM).partition(".")
            tensor = whole_on_cpu.get(name) if logical.startswith(OPTIM) and key != "step" else None
            if (
                tensor is None
                or record.shape != list(tensor.shape)
                or record.dtype != str(tensor.dtype).removeprefix("torch.")
            ):
                continue
            moments[logical] = torch.empty(record.shape, dtype=tensor.dtype)
        return moments

    return fresh_moments


def restore_rng(checkpoint: Checkpoint, device: torch.device, rank: int, world_size: int) -> list[str]:
    """Put back this rank's generator states; returns a note for each state that could not be."""
    saved_world = checkpoint.manifest.layout.world_size
    if saved_world != world_size:
        return [f"RNG states were saved by {saved_world} ranks, this run has {world_size}; they restart from run.seed"]
    torch.set_rng_state(_rank_state(checkpoint, RNG + "cpu", rank))
    if device.type == "cpu":
        return []
    name = RNG + device.type
    if name not in checkpoint.manifest.tensors:
        return [f"the checkpoint holds no {device.type} RNG state; it restarts from run.seed"]
    torch.get_device_module(device.type).set_rng_state(_rank_state(checkpoint, name, rank), device)
    return []


def copy_into_piece(targets: dict[str, torch.Tensor], name: str, whole: torch.Tensor, plan: ParallelPlan) -> None:
    """Copy this rank's piece of `whole`, the logical tensor of state-dict entry `name`, into the entry in
    `targets` (the model's state dict), whatever the layout: an FSDP shard, an EP rank's experts, or all of it."""
    piece = plan.piece(name, targets[name])
    window = tuple(slice(start, start + size) for start, size in zip(piece.offset, piece.local.shape, strict=True))
    with torch.no_grad():
        piece.local.copy_(whole[window])


def _box(checkpoint: Checkpoint, name: str, piece: TensorPiece) -> tuple[str, torch.Tensor, tuple[int, ...]]:
    """What `Checkpoint.read_many` reads for `piece` of `name`, once the stored shape is known to fit."""
    stored = checkpoint.record(name).shape
    if stored != list(piece.global_shape):
        raise CheckpointError(
            f"{checkpoint.path}: {name} is stored as {stored}, this model has {list(piece.global_shape)}"
        )
    return name, piece.local, piece.offset


def _same_memory(value: torch.Tensor | None, tensor: torch.Tensor) -> bool:
    """Whether `value` is `tensor`'s own memory (a state dict hands out new views of the same storage)."""
    return (
        value is not None
        and value.data_ptr() == tensor.data_ptr()
        and (value.shape, value.stride(), value.dtype) == (tensor.shape, tensor.stride(), tensor.dtype)
    )


def _adoptable(value: torch.Tensor | None, tensor: torch.Tensor, piece: TensorPiece, plan: ParallelPlan) -> bool:
    """Whether a prefetched whole tensor can be the optimizer state of `tensor`, held whole, as it is."""
    return (
        value is not None
        and plan.held_whole(tensor, piece)
        and (value.shape, value.dtype, value.device) == (tensor.shape, tensor.dtype, tensor.device)
    )


def _placed_like(value: torch.Tensor, piece: TensorPiece, plan: ParallelPlan) -> TensorPiece:
    """Optimizer state `value` of the tensor at `piece`, placed where that tensor is."""
    return TensorPiece(plan.local(value), piece.offset, piece.global_shape)


def _rank_row(state: torch.Tensor, rank: int, world_size: int) -> TensorPiece:
    return TensorPiece(state.unsqueeze(0), (rank, 0), (world_size, state.numel()))


def _rank_state(checkpoint: Checkpoint, name: str, rank: int) -> torch.Tensor:
    row = torch.empty(1, checkpoint.record(name).shape[1], dtype=torch.uint8)
    checkpoint.read_into(name, row, (rank, 0))
    return row[0]


def shared_verification(context: DistContext) -> SharedVerification | None:
    """In a multi-rank job the ranks split the hashing of a checkpoint's files and agree on the verdict."""
    if not context.is_distributed:
        return None
    return SharedVerification(context.rank, context.world_size, partial(gather_objects, context))
