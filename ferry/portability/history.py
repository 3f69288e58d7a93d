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

from ferry.metrics.jsonl import read_json_lines

HISTORY_DIR = Path("runs") / "portability"
REHEARSALS = "rehearsals.jsonl"
KERNEL_BENCH = "kernel-bench.jsonl"


def append_record(history_dir: str | Path, name: str, record: dict) -> Path:
    """Append `record` as one line of `history_dir/name`, on disk before this returns."""
    path = Path(history_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, separators=(",", ":"), default=str) + "\n"
    with path.open("a", encoding="utf-8") as handle:
        handle.write(line)
        handle.flush()
        os.fsync(handle.fileno())
    return path


def read_records(history_dir: str | Path, name: str) -> list[tuple[int, dict]]:
    """Every record of `history_dir/name` with its line number (a report cites it); none when the file is absent.

    A last line cut short by a crash is ignored; a damaged line elsewhere is refused, naming it.
    """
    path = Path(history_dir) / name
    return read_json_lines(path) if path.exists() else []
