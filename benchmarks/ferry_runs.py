"""A `ferry train` run from a benchmark script: its step records after the warm-up, or why it failed, in a line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path


def train_records(command: list[str], run_dir: Path, warmup_steps: int, cwd: Path) -> list[dict] | str:
    """Run `command` (a `ferry train` writing to `run_dir`); its metrics records past `warmup_steps`, or the error
    lines of its stderr when it exits non-zero (a failed mode is a row of the table, not the end of the run)."""
    finished = subprocess.run(command, capture_output=True, text=True, cwd=cwd)
    if finished.returncode != 0:
        lines = finished.stderr.strip().splitlines() or ["no output"]
        causes = [line for line in lines if "Error" in line or "error:" in line]
        return " | ".join(dict.fromkeys([*causes[-2:], lines[-1]]))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][warmup_steps:]
