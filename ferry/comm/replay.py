"""Whether the forward now running is a replay: activation checkpointing recomputing a block in the backward.

A recompute runs the block's code again, collectives included; under ferry's policies their results come from
the first run (`ferry/model/recompute.py`), so no bytes move a second time. The collectives ask here so that the
communication statistics count each exchange once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_replaying: ContextVar[bool] = ContextVar("ferry_replaying", default=False)


def replaying() -> bool:
    return _replaying.get()


@contextmanager
def replay(active: bool = True) -> Iterator[None]:
    """Mark the code inside as a replay (or not: `active=False` for the first run)."""
    token = _replaying.set(active)
    try:
        yield
    finally:
        _replaying.reset(token)
