"""Run one function on N local processes joined in a gloo (or given) process group.

Used by tests and benchmarks: every rank's exception comes back with its rank
and traceback, and a job that does not finish in time is killed, never left hanging.

The ranks are forked from a server process started once per calling process, which has imported torch,
its distributed package and ferry's trainer, what the jobs run here need (named, not imported: this layer
depends on none above it): a fresh interpreter spends ~5 s on them, torch's compiler stack included (every
optimizer imports it), far more than a tiny job's work; anything else a job's function needs its ranks
import when they unpickle it. No process group or device exists in the server to be inherited. A rank gets its
caller's environment as it is at the call (the server's is the one of its start), with the job's variables on top. Its
output goes where the server's went when it started, which under a test runner's capture is not the calling test's:
what a rank has to say comes back as its result or, when it raises, as its traceback in `RankFailure`.
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

PRELOADED = ["torch", "torch.distributed", "ferry.train"]


class RankFailure(RuntimeError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 180.0) -> list[Any]:
    """Call `fn(*args)` on `world_size` local processes; return each rank's result, in rank order."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)  # read when the server starts, on the first call
    results = context.Queue()
    port = free_port()
    environment = dict(os.environ)
    processes = [
        context.Process(target=_entry, args=(fn, rank, world_size, port, args, results, environment), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    try:
        while len(outcomes) < world_size:
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except queue.Empty:
                raise RankFailure(
                    f"ranks {sorted(set(range(world_size)) - set(outcomes))} did not finish within {timeout_s:.0f} s"
                ) from None
            outcomes[rank] = (ok, value)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    failures = [f"rank {rank}:\n{value}" for rank, (ok, value) in sorted(outcomes.items()) if not ok]
    if failures:
        raise RankFailure("\n".join(failures))
    return [outcomes[rank][1] for rank in range(world_size)]


def _entry(fn, rank, world_size, port, args, results, environment: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    import torch

    torch.set_num_threads(1)
    try:
        results.put((rank, True, fn(*args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
