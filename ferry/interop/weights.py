"""A checkpoint's model, whole, in plain CPU tensors: what export writes and import produces."""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import ValidationError

from ferry.checkpoint import Checkpoint
from ferry.config import UserError
from ferry.data.manifest import TOKENIZER_NAME
from ferry.model import ModelConfig

MODEL = "model."


def checkpoint_model_config(checkpoint: Checkpoint) -> ModelConfig:
    try:
        return ModelConfig.model_validate(checkpoint.manifest.model)
    except ValidationError as exc:
        raise UserError(f"{checkpoint.path}: its model config is not one this ferry reads: {exc.errors()[0]['msg']}") from None


def read_model_state(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """Every `model.*` tensor, whole, under the model's state-dict names."""
    return {name.removeprefix(MODEL): checkpoint.read(name) for name in checkpoint.names(MODEL)}


def checkpoint_tokenizer_path(checkpoint: Checkpoint) -> Path | None:
    """The tokenizer of the first dataset the run trained on, else the one `ferry import` put beside the
    checkpoints; None when neither exists."""
    sources = checkpoint.manifest.run_config.get("data", {}).get("sources") or []
    candidates = [Path(sources[0]["path"]) / TOKENIZER_NAME] if sources else []
    candidates.append(checkpoint.path.parent.parent / TOKENIZER_NAME)
    return next((path for path in candidates if path.is_file()), None)
