"""One JSON object per step in `<run.dir>/metrics.jsonl`: the record every tool reads."""

from __future__ import annotations

import json
from pathlib import Path

from ferry.config import UserError
from ferry.metrics.names import METRICS_FILE


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


def metrics_path(run: str | Path) -> Path:
    """A run directory's `metrics.jsonl`, or the file itself when given one."""
    path = Path(run)
    return path / METRICS_FILE if path.is_dir() else path


def read_metrics(run: str | Path) -> list[dict]:
    """The records of a run (a run directory or a metrics.jsonl file), in file order.

    A last line cut short by a crash is ignored, as the run that wrote it would; a
    damaged line anywhere else means the file is not a ferry record and is refused.
    """
    path = metrics_path(run)
    if not path.is_file():
        raise UserError(f"{str(run)!r} is neither a run directory holding {METRICS_FILE} nor such a file")
    records = []
    for number, record in read_json_lines(path):
        if not isinstance(record.get("step"), int):
            raise UserError(f"{path}: line {number} is not a step record (no integer 'step')")
        records.append(record)
    if not records:
        raise UserError(f"{path} holds no step records")
    return records


def read_json_lines(path: Path) -> list[tuple[int, dict]]:
    """Every JSON object of an append-only JSON-lines file, with its line number.

    A last line cut short by a crash is ignored, as the writer would; a damaged line
    anywhere else, or one that is not an object, is refused, naming it.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines):
                break
            raise UserError(f"{path}: line {number} is not JSON") from None
        if not isinstance(record, dict):
            raise UserError(f"{path}: line {number} is not a JSON object")
        records.append((number, record))
    return records
