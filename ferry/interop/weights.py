"""A checkpoint's model, whole, in plain CPU tensors: what export writes and import produces."""

from __future__ import annotations

import torch
from pydantic import ValidationError

from ferry.checkpoint import Checkpoint
from ferry.config import UserError
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
