"""A checkpoint's model, whole, in plain CPU tensors: what export writes and import produces."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors import safe_open
from safetensors.torch import save_file

from ferry.checkpoint import Checkpoint
from ferry.config import UserError
from ferry.data.manifest import TOKENIZER_NAME
from ferry.data.tokenizer import encoding_digest, load_tokenizer
from ferry.model import ModelConfig

MODEL = "model."


def checkpoint_model_config(checkpoint: Checkpoint) -> ModelConfig:
    try:
        return ModelConfig.model_validate(checkpoint.manifest.model)
    except ValidationError as exc:
        raise UserError(
            f"{checkpoint.path}: its model config is not one this ferry reads: {exc.errors()[0]['msg']}"
        ) from None


def read_model_state(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """Every `model.*` tensor, whole, under the model's state-dict names."""
    return {name.removeprefix(MODEL): checkpoint.read(name) for name in checkpoint.names(MODEL)}


def weight_count(state: dict[str, torch.Tensor], config: ModelConfig) -> int:
    """The model's trained weights, counted one way by export and import so their reports agree: a router's
    balancing bias (a buffer moved by the loads, not by gradients; a `e_score_correction_bias` on the other side
    where it is kept at all) is no weight, and a tied head is the embedding's matrix under a second name."""
    tied = {"output.weight"} if config.tie_embeddings else set()
    return sum(
        tensor.numel() for name, tensor in state.items() if not name.endswith("expert_bias_E") and name not in tied
    )


def checkpoint_tokenizer_path(checkpoint: Checkpoint, given: str | Path | None = None) -> Path | None:
    """`given` (a `--tokenizer`), else the tokenizer of the first dataset the run trained on, else the one
    `ferry import` put beside the checkpoints; None when none exists.

    The data path is the run's, relative to where it ran: in another directory or clone it may hold
    another tokenizer (the demo's is trained on the Python version's own library), which would decode
    the model's ids into other text. So where the checkpoint records its tokenizer's `encoding_digest`,
    only a tokenizer that encodes the same way is taken, and a given one that does not is refused.
    """
    recorded = (checkpoint.manifest.train_state.get("tokenizer") or {}).get("encoding_sha256")
    if given is not None:
        _check_tokenizer(Path(given), recorded, checkpoint)
        return Path(given)
    sources = checkpoint.manifest.run_config.get("data", {}).get("sources") or []
    candidates = [Path(sources[0]["path"]) / TOKENIZER_NAME] if sources else []
    candidates.append(checkpoint.path.parent.parent / TOKENIZER_NAME)
    found = [path for path in candidates if path.is_file()]
    matching = [path for path in found if recorded is None or _encoding_digest(path) == recorded]
    if found and not matching:
        _check_tokenizer(found[0], recorded, checkpoint)
    return matching[0] if matching else None


def _check_tokenizer(path: Path, recorded: str | None, checkpoint: Checkpoint) -> None:
    if recorded is None or not path.is_file():
        return
    digest = _encoding_digest(path)
    if digest != recorded:
        raise UserError(
            f"tokenizer {path} encodes text otherwise than the one {checkpoint.path} was trained with (encoding "
            f"digest {digest[:12]}, the checkpoint's {recorded[:12]}); pass --tokenizer with the run's tokenizer.json"
        )


def _encoding_digest(path: Path) -> str:
    return encoding_digest(load_tokenizer(path))


def read_safetensors(hf_dir: Path, wanted: Callable[[str], bool] = lambda name: True) -> dict[str, torch.Tensor]:
    """The tensors of a directory's safetensors files whose names `wanted` accepts, as stored: what transformers'
    model leaves out (multi-token-prediction layers) or cannot read on a CPU (MXFP4 blocks)."""
    tensors = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(path, framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys() if wanted(name)})
    return tensors


def append_safetensors(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Add `tensors` to what `save_pretrained` wrote in `directory`: to its one weights file, or as one more shard
    named in its index, so that a reader of the directory's checkpoint files finds them."""
    if not tensors:
        return
    tensors = {name: tensor.clone() for name, tensor in tensors.items()}  # copies: no two may share memory
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shard = "model-extra.safetensors"
        save_file(tensors, directory / shard, metadata={"format": "pt"})
        listing = json.loads(index.read_text())
        listing["weight_map"].update({name: shard for name in tensors})
        index.write_text(json.dumps(listing, indent=2))
        return
    weights = directory / "model.safetensors"
    merged = read_safetensors(directory)
    save_file({**merged, **tensors}, weights, metadata={"format": "pt"})
