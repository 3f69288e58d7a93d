"""The save policy of a run: when to save, keeping the newest K, and saving off the training thread."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ferry.checkpoint.config import CheckpointConfig
from ferry.checkpoint.format import TensorPiece, parse_step, step_dir_name
from ferry.checkpoint.reader import list_checkpoints
from ferry.checkpoint.writer import CheckpointMeta, save_checkpoint

_LEFTOVERS = (".step-*.partial", ".step-*.replaced")
# Where a resume moves the checkpoints of the branch it leaves (no `step-*` name: no reader lists it).
ABANDONED_DIR = "abandoned"


class CheckpointManager:
    """Saves the train state at the configured interval and on request, in this process.

    With `async_save` (single-process saves) the tensors are copied to host memory
    first (so training may change them at once) and written by one background thread; a new save waits for
    the previous one, and `wait()` raises a failure of the background write.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        root: Path,
        last_step: int | None = None,
        write: Callable[..., Path] = save_checkpoint,
        is_main: bool = True,
    ):
        """`write(root, pieces, meta, max_file_bytes=...)` saves one checkpoint (the default: this process holds
        everything); in a multi-rank job every rank calls it together and only the main rank prunes."""
        self.config = config
        self.root = root
        self.last_step = last_step
        self.saved: list[Path] = []
        self._write_checkpoint = write
        self._is_main = is_main
        self._asynchronous = config.async_save and write is save_checkpoint
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.removed_leftovers = remove_leftovers(root) if is_main else []

    def due(self, step: int) -> bool:
        """Whether a fixed interval asks for a save at `step` (an `auto` interval is decided by the trainer)."""
        interval = self.config.interval
        return isinstance(interval, int) and interval > 0 and step % interval == 0 and step != self.last_step

    def save(
        self, pieces: dict[str, TensorPiece], meta: CheckpointMeta, before_publish: Callable[[], None] | None = None
    ) -> None:
        """Save now (or start a background save); `before_publish` runs once the files are written."""
        self.wait()
        self.last_step = meta.step
        if self._asynchronous:
            snapshot = {name: replace(p, local=p.local.detach().to("cpu", copy=True)) for name, p in pieces.items()}
            self._thread = threading.Thread(
                target=self._write_in_background, args=(snapshot, meta, before_publish), name="ferry-checkpoint-save"
            )
            self._thread.start()
        else:
            pieces = {name: replace(p, local=p.local.detach().cpu()) for name, p in pieces.items()}
            self._write(pieces, meta, before_publish)

    def wait(self) -> None:
        """Block until the save in flight (if any) is on disk; raise what made it fail."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _write(self, pieces: dict[str, TensorPiece], meta: CheckpointMeta, before_publish=None) -> None:
        hook = {"before_publish": before_publish} if before_publish is not None else {}
        path = self._write_checkpoint(self.root, pieces, meta, max_file_bytes=self.config.file_mb << 20, **hook)
        self.saved.append(path)
        if self._is_main:
            prune(self.root, self.config.keep, protect=path)

    def _write_in_background(self, pieces: dict[str, TensorPiece], meta: CheckpointMeta, before_publish) -> None:
        try:
            self._write(pieces, meta, before_publish)
        except BaseException as exc:  # handed to the training thread by wait()
            self._error = exc


def prune(root: Path, keep: int, protect: Path) -> None:
    """Delete all but the newest `keep` checkpoints; never `protect`, the one just written.

    A newer checkpoint left by an abandoned attempt (say one found corrupt) still
    counts among the newest, which is why the fresh one is protected explicitly.
    """
    for path in list_checkpoints(root)[:-keep]:
        if path != protect:
            shutil.rmtree(path)


def remove_leftovers(root: Path) -> list[Path]:
    """Staging directories of saves that never finished (a crash, a SIGKILL); no reader ever looks at them.
    Returns what was removed, for the run's record."""
    removed = []
    if root.is_dir():
        for pattern in _LEFTOVERS:
            for path in root.glob(pattern):
                shutil.rmtree(path)
                removed.append(path)
    return removed


def set_aside_abandoned(root: Path, step: int, resumed: Path) -> list[tuple[Path, Path]]:
    """Move out of `root` the checkpoints that a run resuming from `resumed` (of `step`) leaves behind: those of
    later steps (a rollback, or newer ones found invalid) and one of the same step that is not `resumed`.
    Returns each (old path, new path).

    Left in place, `resume=latest` would take the abandoned branch back after the next failure, and the
    newest `checkpoint.keep` would count them, pruning the checkpoint this run went on from. They are
    kept, not deleted, under `abandoned/resumed-at-step-NNNNNNNN-<time>/`.
    """
    leaving = [
        path
        for path in list_checkpoints(root)
        if parse_step(path) > step or (parse_step(path) == step and path.resolve() != Path(resumed).resolve())
    ]
    if not leaving:
        return []
    folder = root / ABANDONED_DIR / f"resumed-at-{step_dir_name(step)}-{time.strftime('%Y%m%dT%H%M%S')}"
    while folder.exists():
        folder = folder.with_name(folder.name + "-again")
    folder.mkdir(parents=True)
    moved = []
    for path in leaving:
        os.rename(path, folder / path.name)
        moved.append((path, folder / path.name))
    return moved


def clear_checkpoints(root: Path) -> None:
    """Delete every checkpoint of `root`, those set aside by a resume too: what `run.overwrite` does to an
    earlier run's checkpoints."""
    remove_leftovers(root)
    for path in list_checkpoints(root):
        shutil.rmtree(path)
    shutil.rmtree(root / ABANDONED_DIR, ignore_errors=True)
