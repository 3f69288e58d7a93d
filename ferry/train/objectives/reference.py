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
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ferry.checkpoint import Checkpoint, SharedVerification, find_resume_point
from ferry.checkpoint.digests import checkpoint_digest
from ferry.config import UserError
from ferry.model import Transformer
from ferry.platform.file_modes import give_ordinary_mode

CACHE_FORMAT = 1


class ReferenceSource:
    """The stage's parent (`init_from`) as the reference of a preference or RL objective: its checkpoint, verified
    as a resume verifies one, the pointer a checkpoint keeps to it, and a frozen model of its weights laid out as
    the policy is. Built by the run's assembly, which knows the layout; the objective only asks."""

    def __init__(
        self,
        init_from: str | None,
        objective: str,
        verify: str,
        share: SharedVerification | None,
        frozen_model: Callable[[], Transformer],
        restore: Callable[[Checkpoint, Transformer], None],
    ):
        """`frozen_model()` builds an undrawn model laid out like the policy; `restore(checkpoint, model)` reads the
        checkpoint's weights into it in that layout."""
        self.init_from = init_from
        self.objective = objective
        self.verify = verify
        self.share = share
        self._frozen_model = frozen_model
        self._restore = restore

    def checkpoint(self) -> Checkpoint:
        """The checkpoint `init_from` names: the stage's parent and its reference model."""
        if self.init_from is None:
            raise UserError(
                f"train.objective: {self.objective} measures the policy against a reference model, the stage's "
                "parent: set init_from (in a pipeline, init_from: previous)"
            )
        path = Path(self.init_from)
        return find_resume_point(str(path), path, share=self.share, digests=(self.verify,)).checkpoint

    @staticmethod
    def pointer(checkpoint: Checkpoint) -> dict:
        """The pointer a checkpoint of a DPO or GRPO run keeps to its reference."""
        return {
            "checkpoint": str(checkpoint.path),
            "digest": checkpoint_digest(checkpoint.path),
            "step": checkpoint.step,
        }

    def model(self, checkpoint: Checkpoint) -> Transformer:
        """The parent's weights in a second model laid out like the policy, without gradients (all loaded: nothing
        is drawn first)."""
        model = self._frozen_model()
        with checkpoint:
            self._restore(checkpoint, model)
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
