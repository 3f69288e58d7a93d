"""Writing a checkpoint: per-rank safetensors files, the manifest last, then one atomic rename.

The save is split so that several ranks can share it: every rank writes its own
files into the same staging directory (`write_rank_files`), one rank assembles the
manifest from every rank's record (`build_manifest`, `write_manifest`), and the
rename (`publish`) makes the checkpoint appear whole or not at all. Every file and
directory is fsynced before the rename, so a crash or a SIGKILL at any point
leaves at most a dot-prefixed staging directory, never a half-written `step-*`.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ferry.checkpoint.byte_writes import write_tensor_file
from ferry.checkpoint.files import fsync_dir
from ferry.checkpoint.format import (
    CHECKPOINT_FORMAT,
    DEFAULT_FILE_BYTES,
    MANIFEST_NAME,
    FileRecord,
    Layout,
    Manifest,
    PieceRecord,
    TensorPiece,
    TensorRecord,
    coverage_problem,
    dtype_name,
    format_version_of,
    name_group,
    rank_file_name,
    staging_dir_name,
    step_dir_name,
)
from ferry.platform.file_modes import give_ordinary_mode
from ferry.platform.io_threads import io_threads

WRITER_THREADS = "ferry-checkpoint-file"  # the name of the threads that write a rank's files


@dataclass(frozen=True)
class CheckpointMeta:
    """Everything of the manifest that is not about files and tensors; given by the caller."""

    step: int
    tokens_seen: int
    layout: Layout
    model_config: dict
    run_config: dict
    environment: dict
    train_state: dict


@dataclass
class RankRecord:
    """What one rank wrote: its files, and for each logical name its dtype, global shape and piece."""

    files: dict[str, FileRecord] = field(default_factory=dict)
    tensors: dict[str, tuple[str, list[int], PieceRecord]] = field(default_factory=dict)


def save_checkpoint(
    root: Path,
    pieces: dict[str, TensorPiece],
    meta: CheckpointMeta,
    max_file_bytes: int = DEFAULT_FILE_BYTES,
    before_publish: Callable[[], None] | None = None,
    direct: bool = True,
) -> Path:
    """Save a checkpoint whose every piece is held by this process (world size 1); returns its path.

    `before_publish` runs once the tensor files are written and before the manifest makes them a
    checkpoint (fault injection kills the process there). `direct`: the tensor files go past the page
    cache where the filesystem allows (`checkpoint.direct_io`).
    """
    staging = begin_save(root, meta.step)
    record = write_rank_files(staging, 0, pieces, max_file_bytes, direct)
    if before_publish is not None:
        before_publish()
    write_manifest(staging, build_manifest([record], meta))
    return publish(staging, root / step_dir_name(meta.step))


def begin_save(root: Path, step: int) -> Path:
    """A fresh, empty staging directory for the checkpoint of `step` under `root`."""
    root.mkdir(parents=True, exist_ok=True)
    staging = root / staging_dir_name(step)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def write_rank_files(
    staging: Path,
    rank: int,
    pieces: dict[str, TensorPiece],
    max_file_bytes: int = DEFAULT_FILE_BYTES,
    direct: bool = True,
) -> RankRecord:
    """Write this rank's pieces, per name group, into files of at most `max_file_bytes`, each fsynced and hashed
    as it is written (`byte_writes.py`; past the page cache if `direct`), several at once (on this rank's share of
    the host's cores, `io_threads`). Each takes the mode the umask gives `manifest.json`: whoever may read the
    manifest may read the tensors."""
    groups: dict[str, dict[str, TensorPiece]] = {}
    for name, piece in pieces.items():
        piece.check(name)
        groups.setdefault(name_group(name), {})[name] = piece
    record = RankRecord()
    files = {}
    for group, members in groups.items():
        for part, names in enumerate(_parts(members, max_file_bytes)):
            file = rank_file_name(group, rank, part)
            files[file] = {name: members[name].local.detach().contiguous() for name in names}
            for name in names:
                piece = members[name]
                entry = PieceRecord(file=file, offset=list(piece.offset), shape=list(piece.local.shape))
                record.tensors[name] = (dtype_name(piece.local.dtype), list(piece.global_shape), entry)
    with ThreadPoolExecutor(max_workers=io_threads(len(files)), thread_name_prefix=WRITER_THREADS) as pool:
        writing = {file: pool.submit(_write_file, staging / file, tensors, direct) for file, tensors in files.items()}
        record.files = {file: done.result() for file, done in writing.items()}
    return record


def _write_file(path: Path, tensors: dict[str, torch.Tensor], direct: bool) -> FileRecord:
    try:
        written = write_tensor_file(path, tensors, direct)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
    give_ordinary_mode(path)
    return written


def _parts(members: dict[str, TensorPiece], max_file_bytes: int) -> list[list[str]]:
    """Consecutive runs of names whose bytes fit `max_file_bytes`; a larger tensor is a file of its own."""
    parts: list[list[str]] = [[]]
    size = 0
    for name, piece in members.items():
        nbytes = piece.local.nbytes
        if parts[-1] and size + nbytes > max_file_bytes:
            parts.append([])
            size = 0
        parts[-1].append(name)
        size += nbytes
    return parts


def build_manifest(records: list[RankRecord], meta: CheckpointMeta) -> Manifest:
    """Merge every rank's record; a tensor must agree on dtype and shape and be tiled exactly once."""
    files: dict[str, FileRecord] = {}
    tensors: dict[str, TensorRecord] = {}
    for record in records:
        files.update(record.files)
        for name, (dtype, shape, piece) in record.tensors.items():
            known = tensors.get(name)
            if known is None:
                tensors[name] = TensorRecord(dtype=dtype, shape=shape, pieces=[piece])
            elif (known.dtype, known.shape) != (dtype, shape):
                raise ValueError(f"{name}: ranks disagree on dtype/shape: {known.dtype}{known.shape} vs {dtype}{shape}")
            else:
                known.pieces.append(piece)
    for name, tensor in tensors.items():
        problem = coverage_problem(tensor.shape, [(p.offset, p.shape) for p in tensor.pieces])
        if problem:
            raise ValueError(f"{name}: {problem}")
    return Manifest(
        format=CHECKPOINT_FORMAT,
        format_version=format_version_of(tensors),
        step=meta.step,
        tokens_seen=meta.tokens_seen,
        created_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        layout=meta.layout,
        model=meta.model_config,
        run_config=meta.run_config,
        environment=meta.environment,
        train_state=meta.train_state,
        files=files,
        tensors=tensors,
    )


def write_manifest(staging: Path, manifest: Manifest) -> None:
    """The manifest goes in after every tensor file is on disk: a directory without one is incomplete."""
    path = staging / MANIFEST_NAME
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(manifest.to_json())
        handle.flush()
        os.fsync(handle.fileno())


def publish(staging: Path, final: Path) -> Path:
    """Rename the finished staging directory to its final name, durably.

    A directory already at `final` (a checkpoint of the same step from an abandoned
    attempt, e.g. one found corrupt) is moved aside first and removed after.
    """
    fsync_dir(staging)
    displaced = None
    if final.exists():
        displaced = final.with_name(f".{final.name}.replaced")
        shutil.rmtree(displaced, ignore_errors=True)
        os.rename(final, displaced)
    os.rename(staging, final)
    fsync_dir(final.parent)
    if displaced is not None:
        shutil.rmtree(displaced)
    return final
