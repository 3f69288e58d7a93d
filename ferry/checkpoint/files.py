"""Whole-file helpers shared by the writer and the verifier: hashing and fsync."""

from __future__ import annotations

import os
from pathlib import Path

from ferry.checkpoint.digests import RECORDED
from ferry.checkpoint.format import FileRecord
from ferry.platform.digests import digest_file


def record_file(path: Path, fsync: bool = False) -> FileRecord:
    """What the manifest says of a file: its size and every recorded digest; with `fsync`, also force it
    to stable storage."""
    size = path.stat().st_size
    return FileRecord(bytes=size, **digest_file(path, RECORDED, fsync=fsync))


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
