"""One JSON object per step in `<run.dir>/metrics.jsonl`: the record every tool reads."""

from __future__ import annotations

import json
from pathlib import Path


class JsonlSink:
    """Appends one line per step and flushes it, so a crash loses at most the step in flight."""

    def __init__(self, path: Path):
        self.path = path
        self._handle = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._handle.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()
