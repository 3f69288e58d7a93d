"""The reference model of the preference and RL stages: the stage's parent checkpoint, frozen.

A DPO or GRPO run keeps only a pointer to its parent (`init_from`, with the digest of its
manifest) in its checkpoints; the reference is rebuilt from it when needed. DPO needs the
reference only through its log-probabilities of fixed answers, so they are computed once
and cached on disk under a key that hashes the parent's digest, the dataset, the model
and precision settings: a rerun reuses them; a new parent or new data recomputes them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from ferry.checkpoint import Checkpoint, find_resume_point
from ferry.checkpoint.digests import checkpoint_digest
from ferry.config import UserError
from ferry.model import Transformer
from ferry.platform.file_modes import give_ordinary_mode
from ferry.train.checkpointing import restore_model
from ferry.train.train_state import shared_verification

if TYPE_CHECKING:
    from ferry.train.trainer import Trainer

CACHE_FORMAT = 1


def parent_checkpoint(trainer: Trainer) -> Checkpoint:
    """The checkpoint `init_from` names: the stage's parent and its reference model."""
    config = trainer.config
    if config.init_from is None:
        raise UserError(
            f"train.objective: {config.train.objective} measures the policy against a reference model, the stage's "
            "parent: set init_from (in a pipeline, init_from: previous)"
        )
    path = Path(config.init_from)
    share = shared_verification(trainer)
    return find_resume_point(str(path), path, share=share, digests=(config.checkpoint.verify,)).checkpoint


def reference_record(checkpoint: Checkpoint) -> dict:
    """The pointer a checkpoint of a DPO or GRPO run keeps to its reference."""
    return {"checkpoint": str(checkpoint.path), "digest": checkpoint_digest(checkpoint.path), "step": checkpoint.step}


def build_reference_model(trainer: Trainer, checkpoint: Checkpoint) -> Transformer:
    """The parent's weights in a second model laid out like the policy, without gradients (all loaded: nothing
    is drawn first)."""
    model = Transformer(trainer.config.model, trainer.kernels, initialise=False)
    model = model.to(trainer.device, dtype=trainer.precision.torch_param_dtype)
    trainer.plan.lay_out_frozen(model)
    with checkpoint:
        restore_model(checkpoint, model, trainer.plan)
    model.requires_grad_(False)
    return model.eval()


class LogprobCache:
    """Reference log-probs of one dataset's records, in `DIR/<key>.safetensors`."""

    def __init__(self, directory: Path, inputs: dict):
        self.inputs = {"format": CACHE_FORMAT, **inputs}
        self.key = hashlib.sha256(json.dumps(self.inputs, sort_keys=True).encode("utf-8")).hexdigest()[:32]
        self.path = Path(directory) / f"{self.key}.safetensors"

    def load(self) -> torch.Tensor | None:
        """The cached `[records, fields]` float64 log-probs, or None when absent or unreadable."""
        if not self.path.is_file():
            return None
        try:
            return load_file(str(self.path))["logps"]
        except Exception:  # a torn or foreign file is recomputed, never trusted
            return None

    def save(self, logps: torch.Tensor) -> None:
        """Write atomically: a crash leaves the old entry or none, never half a file; with the umask's mode,
        not safetensors' 0600, as the run's other files have."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staging = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        tensors = {"logps": logps.double().cpu().contiguous()}
        save_file(tensors, str(staging), metadata={"inputs": json.dumps(self.inputs)})
        give_ordinary_mode(staging)
        os.replace(staging, self.path)
