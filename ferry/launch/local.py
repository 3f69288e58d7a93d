"""`ferry train CONFIG --nproc N`: the same job torchrun would start, from one command.

Each rank runs `python -m ferry <command> ...` exactly as under
`torchrun --nproc-per-node N -m ferry ...`; a rank that fails is reported with its
rank and exit code, and the launcher stops the others instead of letting them hang.
A launcher told to stop (SIGTERM, Ctrl-C) stops its ranks and ends by the same signal;
a launcher that dies takes its ranks with it (`ferry.platform.process.die_with_parent`).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ferry.comm.spawn import free_port
from ferry.platform.process import Stopped


@dataclass
class Outcome:
    """How one launch of the ranks ended: exit code by rank (negative: the signal), the first failure's time."""

    exit_codes: dict[int, int] = field(default_factory=dict)
    failed_at_unix: float | None = None

    @property
    def ok(self) -> bool:
        return not self.exit_codes

    @property
    def own_codes(self) -> set[int]:
        """Exit codes of the ranks that failed by themselves (not stopped by the launcher after another failed)."""
        return {code for code in self.exit_codes.values() if code >= 0}

    @property
    def bad_input(self) -> bool:
        """Every rank that failed by itself refused its input (exit code 2): a restart would refuse it again."""
        return self.own_codes == {2}

    def exit_code(self) -> int:
        return 0 if self.ok else 2 if self.bad_input else 1


@contextmanager
def _one_thread_per_rank(nproc: int) -> Iterator[None]:
    """OMP_NUM_THREADS=1 for the ranks when several share the node and it is unset, as torchrun's command sets it
    (torch's launch API does not): otherwise each rank takes every core, and 2 ranks on 2 cores run 4 threads.
    Set but empty counts as unset: libgomp rejects an empty value and falls back to every core."""
    given = os.environ.get("OMP_NUM_THREADS")
    if nproc == 1 or (given is not None and given.strip()):
        yield
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if given is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = given


def run_ranks(nproc: int, argv: list[str], report: bool = True) -> Outcome:
    """Run `python -m ferry *argv` on `nproc` local ranks once; every failure is named by rank."""
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"ferry-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=0,
        monitor_interval=0.2,
    )
    try:
        with _one_thread_per_rank(nproc):
            elastic_launch(config, sys.executable)("-m", "ferry", *argv)
    except SignalException as exc:  # the launcher was told to stop; the agent has stopped the ranks with SIGTERM
        raise Stopped(exc.sigval) from None
    except ChildFailedError as exc:
        outcome = Outcome()
        for rank, failure in sorted(exc.failures.items()):
            outcome.exit_codes[rank] = failure.exitcode
            stamp = failure.timestamp or time.time()
            outcome.failed_at_unix = min(outcome.failed_at_unix or stamp, stamp)
            if not report:
                continue
            if failure.exitcode == -9:
                print(f"ferry: rank {rank} was killed (SIGKILL)", file=sys.stderr)
            elif failure.exitcode < 0:
                print(f"ferry: rank {rank} was stopped by the launcher (signal {-failure.exitcode})", file=sys.stderr)
            else:
                print(f"ferry: rank {rank} exited with code {failure.exitcode}", file=sys.stderr)
        return outcome
    return Outcome()


def launch_local(nproc: int, argv: list[str]) -> int:
    """Run `python -m ferry *argv` on `nproc` local ranks.

    Returns 0 on success, 2 when every rank that failed by itself failed on bad input
    (ranks the launcher stopped after the first failure do not count), 1 otherwise.
    """
    return run_ranks(nproc, argv).exit_code()
