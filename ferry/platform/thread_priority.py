"""A helper thread that yields the CPU to training: its niceness raised, the threads it starts included.

A background checkpoint writer hashes every byte it writes (sha256 at about 2 GB/s a core). Where training keeps
every core busy, a writer at training's priority takes an equal share of the cores for as long as it writes, and
the steps meanwhile run up to twice as long; on two CPU ranks that cost more than the background saves gained
(docs/performance.md, "Asynchronous checkpoint saves"). With its niceness raised, the writer takes the time
training leaves, and a share that shrinks with the niceness (at 10, about a tenth of a core that training also
wants) so that a save still ends. On Linux niceness belongs to each thread, and a thread starts with its
creator's, so the writer's helper threads follow it; raising it needs no privilege. Elsewhere the call changes
nothing: there `setpriority` would lower the whole process, training with it.
"""

from __future__ import annotations

import os
import sys
import threading

MOST_NICE = 19


def lower_this_thread(niceness: int) -> bool:
    """Raise the calling thread's niceness by `niceness` (at most to 19); whether it was done (Linux only, and
    where no security policy refuses it: a priority is advice, so a refusal is no error)."""
    if niceness <= 0 or not sys.platform.startswith("linux"):
        return False
    thread = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(os.PRIO_PROCESS, thread, min(MOST_NICE, current + niceness))
    except OSError:  # a security policy may refuse it: the thread then only competes as an equal
        return False
    return True
