"""Where a benchmark writes: a fresh directory under `--dir` (default `runs/`), removed when it is done (kept where
`keep()` says so at the end: what a failure's commands need to run again)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

DIR_HELP = "where to write (default: a temporary directory under runs/)"


@contextmanager
def scratch_dir(base: str | None, prefix: str, keep: Callable[[], bool] = lambda: False) -> Iterator[Path]:
    root = Path(base) if base else Path("runs")
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    try:
        yield work
    finally:
        if not keep():
            shutil.rmtree(work, ignore_errors=True)
