"""Checkpoints: a neutral format (safetensors + JSON manifest), atomic saves, verified loads.

The format and why it is not torch.distributed.checkpoint: docs/checkpoint-format.md.
"""

from ferry.checkpoint.config import CheckpointConfig
from ferry.checkpoint.diff import Difference, config_differences
from ferry.checkpoint.format import CheckpointError, Layout, Manifest, TensorPiece
from ferry.checkpoint.manager import CheckpointManager, clear_checkpoints, set_aside_abandoned
from ferry.checkpoint.ranked import SaveFailed
from ferry.checkpoint.reader import (
    Checkpoint,
    Found,
    Prefetch,
    SharedVerification,
    find_resume_point,
    latest_checkpoint,
    list_checkpoints,
    newest_valid,
    read_manifest,
    verify_checkpoint,
)
from ferry.checkpoint.report import inspect_lines, verify_lines
from ferry.checkpoint.writer import (
    CheckpointMeta,
    RankRecord,
    begin_save,
    build_manifest,
    publish,
    save_checkpoint,
    write_manifest,
    write_rank_files,
)

__all__ = [
    "CheckpointConfig",
    "Difference",
    "config_differences",
    "CheckpointError",
    "Layout",
    "Manifest",
    "TensorPiece",
    "CheckpointManager",
    "SaveFailed",
    "clear_checkpoints",
    "set_aside_abandoned",
    "Checkpoint",
    "Found",
    "Prefetch",
    "SharedVerification",
    "find_resume_point",
    "latest_checkpoint",
    "list_checkpoints",
    "newest_valid",
    "read_manifest",
    "verify_checkpoint",
    "inspect_lines",
    "verify_lines",
    "CheckpointMeta",
    "RankRecord",
    "begin_save",
    "build_manifest",
    "publish",
    "save_checkpoint",
    "write_manifest",
    "write_rank_files",
]
