"""How many threads one rank's checkpoint files are written or hashed on: its share of the host's cores.

A save writes a rank's files several at once, each thread hashing every byte it moves and holding its file's
staging buffers (`file_writes.HashedFileWriter`: 16 MiB); a resume hashes them several at once. Every rank on a
host does so at the same moment, so a pool as wide as the host on each rank would run, on a 96-core node with 8
ranks, 768 threads on 96 cores holding 12 GiB of buffers. A rank takes the cores this process may run on (its
affinity mask, narrower than the host in a container or under a scheduler's binding) divided by the ranks the
launcher started on the host (`LOCAL_WORLD_SIZE`, which torchrun and `ferry.comm.spawn` set).

At least two, so that a rank always hashes one file while another's bytes go to or come from the disk; on the
2-core machines of docs/performance.md that is what two ranks had before, where one each was measured slower
(whole run 1.076 and 1.101 against 1.045 and 1.021). A scheduler that binds each rank to its own cores leaves a
rank fewer threads than its mask allows (its share is counted twice); two threads a rank still keep a node's
storage busy.
"""

from __future__ import annotations

import os

FEWEST = 2


def io_threads(tasks: int) -> int:
    """The threads for `tasks` files of this rank: its share of the usable cores, at least two, at most `tasks`
    (and at least one)."""
    share = max(FEWEST, usable_cores() // ranks_on_host())
    return max(1, min(tasks, share))


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask where the platform has one, else every core."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def ranks_on_host() -> int:
    """How many ranks the launcher started on this host (1 for a plain process, or where the variable is no
    number: the count only sizes a pool)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1
