"""One checkpoint written by every rank of a job, with no collective in the writing: each rank's writer leaves a
marker beside its tensor files when they are durable, and the main rank's writer publishes once every marker is
there.

A collective issued from a writer thread on the training's process group would interleave with the training's
own collectives and hang both, so the writers agree through the checkpoint directory (a shared file system, which
a multi-node checkpoint needs anyway): `rank-NNNNN.done.json` holds the rank's record (its files, their digests,
its pieces), `rank-NNNNN.failed.json` the error that stopped it. The publisher stops waiting at the first failure
marker, or when the training thread, which learns of a failure through a later step's check, tells it to
(`abandon`): a writer that could not even leave a marker (a full disk) does not keep it waiting. Nothing is
published unless every rank's pieces are on disk; the markers are removed before the manifest goes in.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ferry.checkpoint.format import CheckpointError, FileRecord, PieceRecord
from ferry.checkpoint.writer import (
    CheckpointMeta,
    RankRecord,
    build_manifest,
    publish,
    write_manifest,
    write_rank_files,
)

_DONE = "rank-{rank:05d}.done.json"
_FAILED = "rank-{rank:05d}.failed.json"


class SaveFailed(CheckpointError):
    """A save that did not complete (the storage refused a write, or a rank failed): nothing of it was
    published. Reported as one message; exit code 1, since the input was fine."""

    exit_code = 1


class SaveAbandoned(Exception):
    """The publisher was told to stop waiting: another rank's failure is being reported by the training thread."""


def write_share(
    staging: Path,
    rank: int,
    pieces: dict,
    max_file_bytes: int,
    before_publish: Callable[[Path], None] | None = None,
    direct: bool = True,
) -> None:
    """Write this rank's pieces into `staging`, then its done marker; on any failure its failed marker (if the
    storage still takes one) and raise. `before_publish(staging)` runs once the tensor files are written (fault
    injection strikes there); `direct`: past the page cache where the filesystem allows."""
    try:
        staging.mkdir(parents=True, exist_ok=True)
        record = write_rank_files(staging, rank, pieces, max_file_bytes, direct)
        if before_publish is not None:
            before_publish(staging)
        _write_marker(staging / _DONE.format(rank=rank), _record_json(record))
    except Exception as exc:
        try:
            _write_marker(staging / _FAILED.format(rank=rank), json.dumps({"error": describe_failure(exc)}))
        except OSError:
            pass  # the training thread's check reports it without the marker
        raise


def publish_when_complete(
    staging: Path,
    final: Path,
    world_size: int,
    meta: CheckpointMeta,
    abandon: threading.Event | None = None,
    poll_s: float = 0.005,
) -> Path:
    """Once every rank's done marker is in `staging`, write the manifest and publish it as `final`. Raises
    `SaveFailed` at a failure marker (naming its rank and error) and `SaveAbandoned` once `abandon` is set."""
    records: dict[int, RankRecord] = {}
    while len(records) < world_size:
        for rank in range(world_size):
            if rank in records:
                continue
            failed = staging / _FAILED.format(rank=rank)
            if failed.exists():
                raise SaveFailed(f"rank {rank}: {json.loads(failed.read_text())['error']}")
            done = staging / _DONE.format(rank=rank)
            if done.exists():
                records[rank] = _record_from_json(done.read_text())
        if len(records) < world_size:
            if abandon is not None and abandon.is_set():
                raise SaveAbandoned(f"{final.name}: {world_size - len(records)} rank(s) wrote no marker")
            time.sleep(poll_s)
    for rank in range(world_size):
        (staging / _DONE.format(rank=rank)).unlink()
    write_manifest(staging, build_manifest([records[rank] for rank in range(world_size)], meta))
    return publish(staging, final)


def failure_of(staging: Path, rank: int) -> str | None:
    """What stopped rank `rank`'s writer, as its failure marker says (None: it left none)."""
    failed = staging / _FAILED.format(rank=rank)
    try:
        return json.loads(failed.read_text())["error"]
    except (OSError, ValueError, KeyError):
        return None


def describe_failure(exc: BaseException) -> str:
    """An error of a save in one line: the path and the operating system's reason where there are."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return f"{type(exc).__name__}: {exc}"


def _write_marker(path: Path, text: str) -> None:
    """Written whole under a temporary name, synced, then renamed: a reader sees all of it or nothing."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.rename(partial, path)


def _record_json(record: RankRecord) -> str:
    return json.dumps(
        {
            "files": {name: file.model_dump() for name, file in record.files.items()},
            "tensors": {
                name: [dtype, shape, piece.model_dump()] for name, (dtype, shape, piece) in record.tensors.items()
            },
        }
    )


def _record_from_json(text: str) -> RankRecord:
    data = json.loads(text)
    record = RankRecord()
    record.files = {name: FileRecord(**file) for name, file in data["files"].items()}
    record.tensors = {
        name: (dtype, shape, PieceRecord(**piece)) for name, (dtype, shape, piece) in data["tensors"].items()
    }
    return record
