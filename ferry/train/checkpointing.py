"""The trainer's state under logical checkpoint names, and back into a model, optimizer and RNG.

Names (docs/checkpoint-format.md), all independent of world size, device and precision:

  model.<state_dict key>          every parameter and persistent buffer (routers' expert_bias_E too)
  optim.<state key>.<param name>  AdamW `exp_avg`, `exp_avg_sq` and `step` of parameter model.<param name>
  rng.cpu, rng.<device type>      generator states, one row per rank: [world_size, state bytes]

The rest (data cursor, schedule position, optimizer kind and parameter groups) is JSON
in the manifest's `train_state`.
"""

from __future__ import annotations

import torch
from torch import nn

from ferry.checkpoint import Checkpoint, CheckpointError, TensorPiece, config_differences
from ferry.config import ConfigError
from ferry.train.config import RunConfig

MODEL = "model."
OPTIM = "optim."
RNG = "rng."

# Keys that say where and how a run is recorded, not what it computes: a resume may change them freely.
_BOOKKEEPING = ("run.name", "run.dir", "run.overwrite", "resume", "checkpoint.")


def train_state_pieces(
    model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, rank: int, world_size: int
) -> dict[str, TensorPiece]:
    """Every tensor of the train state, whole, under its logical name (one rank holds everything)."""
    pieces = {MODEL + name: TensorPiece.whole(tensor) for name, tensor in model.state_dict().items()}
    names = _param_names(model)
    for param, state in optimizer.state.items():
        for key, value in state.items():
            pieces[f"{OPTIM}{key}.{names[param]}"] = TensorPiece.whole(value)
    pieces[RNG + "cpu"] = _rank_row(torch.get_rng_state(), rank, world_size)
    if device.type != "cpu":
        state = torch.get_device_module(device.type).get_rng_state(device)
        pieces[RNG + device.type] = _rank_row(state, rank, world_size)
    return pieces


def optimizer_record(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's kind and parameter groups (hyperparameters, and members by parameter name)."""
    names = _param_names(model)
    groups = []
    for group in optimizer.param_groups:
        hyperparameters = {key: value for key, value in group.items() if key != "params"}
        groups.append({**hyperparameters, "params": [names[param] for param in group["params"]]})
    return {"kind": type(optimizer).__name__, "param_groups": groups}


def check_config(checkpoint: Checkpoint, config: RunConfig) -> list[str]:
    """Refuse a checkpoint of another model, naming each differing field; list the other differences.

    A different model would not fit the stored tensors or would silently compute
    something else. Other sections (optimizer, schedule, data, device) may change on
    purpose, as in a migration or a new stage; they are reported, not refused.
    """
    current = config.model_dump(mode="json")
    model = config_differences(checkpoint.manifest.model, current["model"], "model.")
    if model:
        raise ConfigError(
            f"checkpoint {checkpoint.path} was saved from another model; differing fields:\n  "
            + "\n  ".join(str(difference) for difference in model)
        )
    saved = {key: value for key, value in checkpoint.manifest.run_config.items() if key != "model"}
    rest = config_differences(saved, {key: value for key, value in current.items() if key != "model"})
    return [str(difference) for difference in rest if not difference.key.startswith(_BOOKKEEPING)]


def restore_model(checkpoint: Checkpoint, model: nn.Module) -> None:
    targets = model.state_dict()
    stored = {name.removeprefix(MODEL) for name in checkpoint.names(MODEL)}
    if stored != set(targets):
        missing, unexpected = sorted(set(targets) - stored), sorted(stored - set(targets))
        raise CheckpointError(
            f"{checkpoint.path} does not fit this model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    with torch.no_grad():
        for name, tensor in targets.items():
            _read_whole(checkpoint, MODEL + name, tensor)


def restore_optimizer(checkpoint: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the stored moments and steps; hyperparameters stay those of this run's config.

    The parameter groups must hold the same parameters as when saved, since the
    state is matched to parameters by name. Moments are read straight into tensors
    like their parameter (device and dtype), steps keep their stored form, as
    AdamW keeps them.
    """
    saved = checkpoint.manifest.train_state["optimizer"]
    names = _param_names(model)
    members = [[names[param] for param in group["params"]] for group in optimizer.param_groups]
    if saved["kind"] != type(optimizer).__name__ or [g["params"] for g in saved["param_groups"]] != members:
        raise CheckpointError(
            f"{checkpoint.path}: its {saved['kind']} parameter groups do not match this run's "
            f"{type(optimizer).__name__} groups"
        )
    params = dict(model.named_parameters())
    index = {name: position for position, name in enumerate(name for group in members for name in group)}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for logical in checkpoint.names(OPTIM):
        key, _, name = logical.removeprefix(OPTIM).partition(".")
        if name not in index:
            raise CheckpointError(f"{checkpoint.path}: {logical} belongs to no parameter of this model")
        if key == "step":
            value = checkpoint.read(logical)
        else:
            value = torch.empty_like(params[name], memory_format=torch.contiguous_format)
            _read_whole(checkpoint, logical, value)
        state.setdefault(index[name], {})[key] = value
    state_dict = optimizer.state_dict()
    state_dict["state"] = state
    optimizer.load_state_dict(state_dict)


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


def _param_names(model: nn.Module) -> dict[nn.Parameter, str]:
    return {param: name for name, param in model.named_parameters()}


def _rank_row(state: torch.Tensor, rank: int, world_size: int) -> TensorPiece:
    return TensorPiece(state.unsqueeze(0), (rank, 0), (world_size, state.numel()))


def _rank_state(checkpoint: Checkpoint, name: str, rank: int) -> torch.Tensor:
    row = torch.empty(1, checkpoint.record(name).shape[1], dtype=torch.uint8)
    checkpoint.read_into(name, row, (rank, 0))
    return row[0]


def _read_whole(checkpoint: Checkpoint, name: str, out: torch.Tensor) -> None:
    stored = checkpoint.record(name).shape
    if stored != list(out.shape):
        raise CheckpointError(f"{checkpoint.path}: {name} is stored as {stored}, this model has {list(out.shape)}")
    checkpoint.read_into(name, out)
