"""What `moe.permute` hands to `moe.combine`: where each routed row went."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Dispatch:
    """How the T*K (token, expert) assignments were sorted into expert groups.

    Assignment a = t * K + k is token t's k-th choice. Sorted row n holds assignment
    `order_N[n]`, which is token `token_of_N[n]`; assignment a sits in sorted row
    `inverse_N[a]`. Both directions are kept so that every move of rows, forward or
    backward, is a gather (parallel, deterministic) rather than a scatter-add.
    """

    order_N: torch.Tensor
    token_of_N: torch.Tensor
    inverse_N: torch.Tensor
    top_k: int

    @property
    def num_tokens(self) -> int:
        return self.order_N.numel() // self.top_k


def group_sizes(offsets_E: torch.Tensor) -> list[int]:
    """Rows per group from the group ends, on the host (one device sync for implementations that loop)."""
    return torch.diff(offsets_E, prepend=offsets_E.new_zeros(1)).tolist()


def reads_group_sizes_on_host(fn: Callable) -> Callable:
    """Marks an implementation that reads its group sizes on the host (a device sync on accelerators).

    Such a function loops or allocates by values only known at run time, so a compiled region
    (`train.compile: blocks`) leaves it out, a graph break, instead of tracing it and compiling it
    again for every new set of group sizes; `host_reads` tells the sync-free paths from the others.
    """
    wrapped = torch.compiler.disable(fn)
    wrapped.reads_group_sizes_on_host = True
    return wrapped


def host_reads(fn: Callable) -> bool:
    """Whether a chosen op function (its sub-ops bound or not) was marked `reads_group_sizes_on_host`."""
    return getattr(getattr(fn, "func", fn), "reads_group_sizes_on_host", False)
