"""What the ranks of a job tell each other outside the step: small Python objects, and a user error one rank met.

A user error (bad config, a busy port, a file where a directory goes) that one rank meets while the others go
on leaves them waiting at their next collective, to end on a closed connection with no word of why. Set-up
work that only some ranks do runs under `raise_on_every_rank`, so each rank stops with the same message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from ferry.comm.process_group import DistContext
from ferry.config import UserError

T = TypeVar("T")


def gather_objects(context: DistContext, payload: object) -> list:
    """Every rank's `payload`, in rank order (this rank's alone in a single process)."""
    if not context.is_distributed:
        return [payload]
    payloads: list = [None] * context.world_size
    dist.all_gather_object(payloads, payload)
    return payloads


def raise_on_every_rank(context: DistContext, work: Callable[[], T]) -> T:
    """Run `work` on this rank, and raise on every rank the user error any rank met (the first, by rank)."""
    try:
        result, message = work(), None
    except UserError as exc:
        failure, message = exc, str(exc)
    failed = [(rank, text) for rank, text in enumerate(gather_objects(context, message)) if text is not None]
    if message is not None:
        raise failure
    if failed:
        rank, text = failed[0]
        raise UserError(f"rank {rank}: {text}")
    return result
