"""One live run per run directory: the main rank holds an exclusive lock on `run.dir/.lock` while it runs.

Two jobs writing one run directory (a resume started while the first job still trains, ranks orphaned by a
launcher that died on another machine) interleave their checkpoints, metrics and `run.json`, and a resume
may then load a checkpoint the other job is rewriting. The lock is the kernel's (`flock`): it goes with the
process that holds it, however that process ends, so a crash never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from ferry.config import UserError

LOCK_NAME = ".lock"


class RunDirLock:
    """The held lock of one run directory; `release` when the run ends."""

    def __init__(self, descriptor: int | None):
        self._descriptor = descriptor  # None: the filesystem keeps no locks, and none is held

    @classmethod
    def acquire(cls, run_dir: Path) -> RunDirLock:
        """Take the lock of `run_dir` (created if need be); a `UserError` naming the holder when a live run has it."""
        run_dir.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(descriptor, 4096, 0).decode("utf-8", errors="replace")
            os.close(descriptor)
            raise UserError(
                f"run.dir {str(run_dir)!r} is in use by a live run ({_describe(holder)}); wait for it to end or stop "
                "it before resuming or replacing it, or choose another run.dir"
            ) from None
        except OSError:  # a filesystem without locks (some network mounts): the run goes on unguarded
            os.close(descriptor)
            return cls(None)
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, json.dumps(holder).encode("utf-8"), 0)
        return cls(descriptor)

    def release(self) -> None:
        if self._descriptor is not None:
            os.close(self._descriptor)  # closing the only descriptor of the open file releases its flock
            self._descriptor = None


def _describe(holder: str) -> str:
    try:
        fields = json.loads(holder)
        return f"pid {fields['pid']} on {fields['host']}, since {fields['since']}"
    except (ValueError, KeyError, TypeError):
        return "its holder did not say who it is"
