"""`ferry train CONFIG --nproc N`: the same job torchrun would start, from one command.

Each rank runs `python -m ferry <command> ...` exactly as under
`torchrun --nproc-per-node N -m ferry ...`; a rank that fails is reported with its
rank and exit code, and the launcher stops the others instead of letting them hang.
"""

from __future__ import annotations

import sys
import uuid

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ferry.comm.spawn import free_port


def launch_local(nproc: int, argv: list[str]) -> int:
    """Run `python -m ferry *argv` on `nproc` local ranks.

    Returns 0 on success, 2 when every rank that failed by itself failed on bad input
    (ranks the launcher stopped after the first failure do not count), 1 otherwise.
    """
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
        elastic_launch(config, sys.executable)("-m", "ferry", *argv)
    except ChildFailedError as exc:
        own_codes = set()
        for rank, failure in sorted(exc.failures.items()):
            if failure.exitcode < 0:
                print(f"ferry: rank {rank} was stopped by the launcher (signal {-failure.exitcode})", file=sys.stderr)
            else:
                own_codes.add(failure.exitcode)
                print(f"ferry: rank {rank} exited with code {failure.exitcode}", file=sys.stderr)
        return 2 if own_codes == {2} else 1
    return 0
