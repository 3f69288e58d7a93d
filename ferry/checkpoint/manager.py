"""The save policy of a run: when to save, keeping the newest K, and saving off the training thread.

Every rank writes its own pieces of a checkpoint (`ferry/checkpoint/ranked.py`); the main rank publishes it once
every rank's pieces are durable. A synchronous save does that while training waits. An asynchronous one copies
the pieces to host memory (pinned, on accelerators), and a writer thread per rank writes them while training goes
on. The ranks agree on how a save ended by a check after each later step (one small all-reduce, made only while a
save is in flight, on every rank alike): a failure on any rank reaches every rank at the next step's end.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ferry.checkpoint.config import CheckpointConfig
from ferry.checkpoint.format import TensorPiece, parse_step, staging_dir_name, step_dir_name
from ferry.checkpoint.ranked import (
    SaveAbandoned,
    SaveFailed,
    describe_failure,
    failure_of,
    publish_when_complete,
    write_share,
)
from ferry.checkpoint.reader import list_checkpoints
from ferry.checkpoint.writer import CheckpointMeta
from ferry.platform.thread_priority import lower_this_thread

_LEFTOVERS = (".step-*.partial", ".step-*.replaced")
# Where a resume moves the checkpoints of the branch it leaves (no `step-*` name: no reader lists it).
ABANDONED_DIR = "abandoned"
# How a writer stands, as the ranks agree on it (the largest over the ranks wins)
_WRITTEN, _WRITING, _FAILED = 0.0, 1.0, 2.0
# `async_save: auto` writes in the background when the snapshot takes at most this share of the free host memory
SNAPSHOT_SHARE_OF_HOST = 0.5


@dataclass
class _Save:
    """One save of one rank: what it writes, where, and how its writer ended."""

    pieces: dict[str, TensorPiece]
    meta: CheckpointMeta
    staging: Path
    final: Path
    before_publish: Callable[[Path], None] | None
    copied: torch.cuda.Event | None = None  # the snapshot's copies, on an accelerator
    abandon: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    error: BaseException | None = None
    write_s: float = 0.0

    @property
    def status(self) -> float:
        if self.error is not None:
            return _FAILED
        return _WRITING if self.thread is not None and self.thread.is_alive() else _WRITTEN


class CheckpointManager:
    """Saves the train state at the configured interval and on request, on rank `rank` of `world_size`.

    `agree(values)`: each value's largest over the ranks, on every rank (in one process, the values). A save
    that fails raises `SaveFailed` on every rank, naming the rank, the path and the error; the caller decides
    whether training goes on.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        root: Path,
        last_step: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        agree: Callable[[list[float]], list[float]] | None = None,
    ):
        self.config = config
        self.root = root
        self.last_step = last_step
        self.rank = rank
        self.world_size = world_size
        self.saved: list[Path] = []
        self.asynchronous: bool | None = None if config.async_save == "auto" else config.async_save
        self.async_rule = None if self.asynchronous is None else f"set: checkpoint.async_save {config.async_save}"
        self.blocked_s = 0.0  # what training waited for saves since the last `take_costs`
        self.write_s = 0.0  # what the saves that ended since then took to write
        self._agree = agree or list
        self._in_flight: _Save | None = None
        self._snapshot_buffers: dict[str, torch.Tensor] = {}
        self._snapshot_layout: list | None = None
        self.removed_leftovers = remove_leftovers(root) if rank == 0 else []

    def due(self, step: int) -> bool:
        """Whether a fixed interval asks for a save at `step` (an `auto` interval is decided by the trainer)."""
        interval = self.config.interval
        return isinstance(interval, int) and interval > 0 and step % interval == 0 and step != self.last_step

    def save(
        self,
        pieces: dict[str, TensorPiece],
        meta: CheckpointMeta,
        before_publish: Callable[[Path], None] | None = None,
    ) -> None:
        """Save now, or start a background save; `before_publish(staging)` runs once this rank's files are
        written. Every rank calls it at the same step."""
        started = time.perf_counter()
        try:
            self.wait()
            self.last_step = meta.step
            if self.asynchronous is None:
                self._decide(pieces)
            save = _Save(
                {}, meta, self.root / staging_dir_name(meta.step), self.root / step_dir_name(meta.step), before_publish
            )
            if self.asynchronous:
                save.pieces, save.copied = self._snapshot(pieces)
                save.thread = threading.Thread(
                    target=self._write_in_background, args=(save,), name="ferry-checkpoint-save"
                )
                self._in_flight = save
                save.thread.start()
            else:
                save.pieces = {name: replace(p, local=p.local.detach().cpu()) for name, p in pieces.items()}
                self._write_while_training_waits(save)
        finally:
            self.blocked_s += time.perf_counter() - started

    def poll(self) -> None:
        """After a step, on every rank: whether the save in flight has ended, agreed over the ranks (raises its
        failure on every rank)."""
        if self._in_flight is not None:
            self._settle(wait=False)

    def wait(self) -> None:
        """Block until the save in flight (if any) has ended on every rank; raise its failure."""
        while self._in_flight is not None:
            self._settle(wait=True)

    def written_here(self) -> Path | None:
        """This rank's writer joined, with no collective (its outcome is agreed at the next `poll`): the path of
        the save it wrote, published if this is the main rank; None if it failed. For a fault that acts on one
        rank's copy of a checkpoint."""
        save = self._in_flight
        if save is None:
            return self.saved[-1] if self.saved else None
        save.thread.join()
        return None if save.error is not None else save.final

    def abandon(self) -> None:
        """A failing run's last word on the save in flight (no collective: the other ranks may be gone): this
        rank's writer finishes its files, and the main rank publishes only if every rank's are already there."""
        save, self._in_flight = self._in_flight, None
        if save is not None:
            save.abandon.set()
            save.thread.join()

    def take_costs(self) -> tuple[float, float]:
        """Seconds training waited for saves, and seconds the saves that ended took to write, since last asked."""
        costs = self.blocked_s, self.write_s
        self.blocked_s = self.write_s = 0.0
        return costs

    def _decide(self, pieces: dict[str, TensorPiece]) -> None:
        """`async_save: auto`, at the first save: in the background on a multi-rank run whose every rank's
        snapshot fits in its share of the host's free memory; otherwise (one process, or too little memory) while
        training waits."""
        snapshot = sum(piece.local.nbytes for piece in pieces.values())
        free = available_host_bytes()
        fits = snapshot <= SNAPSHOT_SHARE_OF_HOST * free
        all_fit = self._agree([0.0 if fits else 1.0])[0] == 0.0
        self.asynchronous = self.config.saves_in_background(self.world_size, all_fit)
        if self.world_size == 1:
            self.async_rule = "auto: off, one process (it trains on the cores a writer would take)"
        elif all_fit:
            self.async_rule = (
                f"auto: on, {self.world_size} ranks, every rank's snapshot within "
                f"{SNAPSHOT_SHARE_OF_HOST:.0%} of its free host memory (rank {self.rank}: "
                f"{snapshot / 2**30:.2f} of {free / 2**30:.1f} GiB)"
            )
        else:
            self.async_rule = (
                f"auto: off, a rank's snapshot exceeds {SNAPSHOT_SHARE_OF_HOST:.0%} of its free host "
                f"memory (rank {self.rank}: {snapshot / 2**30:.2f} of {free / 2**30:.1f} GiB)"
            )

    def _snapshot(self, pieces: dict[str, TensorPiece]) -> tuple[dict[str, TensorPiece], torch.cuda.Event | None]:
        """The pieces copied to host memory: into one arena kept from one save to the next while the pieces keep
        their shapes (pinned on an accelerator, copied without blocking: the writer waits for the copies' event,
        training does not; on the CPU backed by huge pages, which a first copy faults in 512 times less often)."""
        layout = [(name, tuple(piece.local.shape), piece.local.dtype) for name, piece in pieces.items()]
        on_accelerator = any(piece.local.device.type == "cuda" for piece in pieces.values())
        if layout != self._snapshot_layout:
            self._snapshot_buffers = _arena_views(layout, pinned=on_accelerator)
            self._snapshot_layout = layout
        snapshot = {}
        for name, piece in pieces.items():
            buffer = self._snapshot_buffers[name]
            buffer.copy_(piece.local.detach(), non_blocking=on_accelerator)
            snapshot[name] = replace(piece, local=buffer)
        copied = None
        if on_accelerator:
            copied = torch.cuda.Event()
            copied.record()
        return snapshot, copied

    def _write_in_background(self, save: _Save) -> None:
        lower_this_thread(self.config.writer_niceness)
        started = time.perf_counter()
        try:
            if save.copied is not None:
                save.copied.synchronize()
            self._write_share(save)
            self._publish(save)
        except SaveAbandoned:
            pass
        except BaseException as exc:  # reported on every rank by the check after a later step
            save.error = exc
        save.write_s = time.perf_counter() - started

    def _write_while_training_waits(self, save: _Save) -> None:
        """Every rank writes its files; once all have (agreed), the main rank publishes (agreed)."""
        started = time.perf_counter()
        for stage in (self._write_share, self._publish):
            try:
                stage(save)
            except Exception as exc:
                save.error = exc
            status, failing = self._agreed(save)
            if status == _FAILED:
                self._failed(save, failing)
        self.write_s += time.perf_counter() - started
        self.saved.append(save.final)

    def _write_share(self, save: _Save) -> None:
        write_share(
            save.staging, self.rank, save.pieces, self.config.file_mb << 20, save.before_publish, self.config.direct_io
        )

    def _publish(self, save: _Save) -> None:
        """On the main rank: the manifest once every rank's files are there, then the older checkpoints pruned."""
        if self.rank == 0:
            publish_when_complete(save.staging, save.final, self.world_size, save.meta, save.abandon)
            prune(self.root, self.config.keep, protect=save.final)

    def _agreed(self, save: _Save) -> tuple[float, int]:
        """How `save` stands over the ranks (the largest of their statuses), and the last rank that failed it."""
        status, failing = self._agree([save.status, float(self.rank) if save.error else -1.0])
        return status, int(failing)

    def _settle(self, wait: bool) -> None:
        """One round of the ranks' agreement on the save in flight; `wait`: give the writer a moment first."""
        save = self._in_flight
        if wait:
            save.thread.join(timeout=0.01)
        status, failing = self._agreed(save)
        if status == _WRITING:
            return
        save.abandon.set()  # a publisher still waiting for a failed rank's marker stops
        save.thread.join()
        self._in_flight = None
        self.write_s += save.write_s
        if status == _FAILED:
            self._failed(save, failing)
        self.saved.append(save.final)

    def _failed(self, save: _Save, rank: int) -> None:
        """Raise the failure of rank `rank`'s part of `save`, with what is left; the main rank clears its
        staging directory."""
        reason = describe_failure(save.error) if rank == self.rank else failure_of(save.staging, rank)
        if self.rank == 0:
            shutil.rmtree(save.staging, ignore_errors=True)
        complete = list_checkpoints(self.root)
        kept = f"the newest complete checkpoint is {complete[-1]}" if complete else "no complete checkpoint exists yet"
        raise SaveFailed(
            f"the checkpoint of step {save.meta.step} was not saved: rank {rank} failed writing it "
            f"({reason or 'it left no failure marker; its own output says why'}); nothing of it was published "
            f"at {save.final}, and {kept}"
        )


def _arena_views(layout: list[tuple[str, tuple, torch.dtype]], pinned: bool) -> dict[str, torch.Tensor]:
    """One host allocation for a snapshot of `layout` (name, shape, dtype), and each name's tensor in it, at
    offsets aligned to 64 bytes."""
    offsets, total = [], 0
    for _, shape, dtype in layout:
        offsets.append(total)
        total += -(-math.prod(shape) * dtype.itemsize // 64) * 64
    if pinned:
        arena = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=True)
    else:
        mapped = mmap.mmap(-1, max(total, 1))
        with contextlib.suppress(AttributeError, OSError):  # huge pages where the platform offers them
            mapped.madvise(mmap.MADV_HUGEPAGE)
        arena = torch.frombuffer(mapped, dtype=torch.uint8)
    return {
        name: arena[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
        for (name, shape, dtype), offset in zip(layout, offsets, strict=True)
    }


def available_host_bytes() -> int:
    """The host memory free for new allocations (Linux's MemAvailable; elsewhere the free pages)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


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
