"""The portability directory: append-only JSON-lines histories that `ferry report` reads.

    runs/portability/rehearsals.jsonl     one line per rehearsal verdict, PASS or FAIL
    runs/portability/kernel-bench.jsonl   one line per `ferry kernels bench`

A line is appended whole and flushed to disk before the command reports; nothing is
ever rewritten in place, so the history of a path is also the evidence for it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ferry.config import UserError

HISTORY_DIR = Path("runs") / "portability"
REHEARSALS = "rehearsals.jsonl"
KERNEL_BENCH = "kernel-bench.jsonl"


def check_history_dir(history_dir: str | Path) -> None:
    """Refuse a history path that cannot become a directory, before a command spends minutes on a verdict
    it could not append."""
    for path in (Path(history_dir), *Path(history_dir).parents):
        if path.exists():
            if not path.is_dir():
                raise UserError(f"--history {str(history_dir)!r}: {path} is a file, not a directory")
            return


def append_record(history_dir: str | Path, name: str, record: dict) -> Path:
    """Append `record` as one line of `history_dir/name`, on disk before this returns."""
    path = Path(history_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, separators=(",", ":"), default=str) + "\n"
    with path.open("a+b") as handle:
        if handle.tell() and (handle.seek(handle.tell() - 1), handle.read(1))[1] != b"\n":
            handle.write(b"\n")  # a line torn by a crash stays a line of its own; this record starts a new one
        handle.write(line.encode("utf-8"))
        handle.flush()
        os.fsync(handle.fileno())
    return path


def read_records(history_dir: str | Path, name: str, damaged: list[int] | None = None) -> list[tuple[int, dict]]:
    """Every record of `history_dir/name` with its line number (a report cites it); none when the file is absent.

    A line that is not a JSON object (torn by a crash, or edited) is left out, and its number added to
    `damaged` for the caller to report: one bad line must not make the rest of the evidence unreadable.
    """
    path = Path(history_dir) / name
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            records.append((number, record))
        elif damaged is not None and line.strip():
            damaged.append(number)
    return records
