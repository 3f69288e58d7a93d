"""How a ferry process ends when something outside it stops it: a signal, or the death of its launcher.

A scheduler ends a job with SIGTERM (Slurm at its time limit, Kubernetes on eviction); a person with
Ctrl-C. In a process that is no rank of an elastic agent, either becomes `Stopped` in the main thread,
so a run records how it ended instead of leaving `run.json` at "running", and the process then ends
by the same signal, so that whoever watches it (a launcher counting which ranks failed by themselves,
a shell) sees a stop, not a failure. A rank whose launcher dies (SIGKILL, an
out-of-memory kill) is killed by the kernel: it would otherwise train on alone and write into a run
directory that a restarted job may already be using.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # from linux/prctl.h


class Stopped(BaseException):
    """A signal asked the process to stop. A `BaseException`, as KeyboardInterrupt is: no handler of
    ordinary errors may take it for a failure of the run and carry on."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        super().__init__(signal.Signals(self.signum).name)

    @property
    def exit_code(self) -> int:
        """What a shell reports for a process ended by this signal."""
        return 128 + self.signum

    def end_process(self) -> None:
        """End this process by the signal itself, with its default action (what SIGTERM alone would have done)."""
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(self.signum, signal.SIG_DFL)
        os.kill(os.getpid(), self.signum)


def stop_on_sigterm() -> None:
    """SIGTERM raises `Stopped` in the main thread (call from the main thread, before the work starts)."""

    def handler(signum: int, frame) -> None:
        raise Stopped(signum)

    signal.signal(signal.SIGTERM, handler)


def die_with_parent() -> bool:
    """Ask the kernel to kill this process when its parent dies (Linux); whether it could. A parent that died
    before the request took effect (this process now has another) ends it at once."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    path = ctypes.util.find_library("c")
    libc = ctypes.CDLL(path, use_errno=True) if path else None
    if libc is None or not hasattr(libc, "prctl") or libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
    return True
