"""Large host tensors on huge pages, for memory that is filled once and kept.

Filling fresh memory on a CPU costs one page fault per 4 KiB page (about 2 us each in a
VM), which makes a first write several times slower than a copy into memory already
mapped: 0.30 s for 0.67 GB against 0.08 s on 2 MiB pages. torch's CPU allocator does
not ask for transparent huge pages unless a process-wide environment switch is set
before its first allocation; numpy's allocator asks (`madvise(MADV_HUGEPAGE)`) for every
block of 4 MiB or more, so a tensor over a numpy block gets them wherever the kernel
offers them (`transparent_hugepage` = `always` or `madvise`), and plain pages elsewhere.
"""

from __future__ import annotations

import math

import numpy as np
import torch

# numpy asks for huge pages from this size on; smaller blocks gain nothing from a detour.
HUGE_PAGE_BLOCK_BYTES = 4 << 20


def empty_host(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor of `shape` and `dtype`, on huge pages where it is large enough."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE_BLOCK_BYTES:
        return torch.empty(shape, dtype=dtype)
    block = torch.from_numpy(np.empty(nbytes, dtype=np.uint8))
    return block.view(dtype).view(shape)


def empty_host_like(tensor: torch.Tensor) -> torch.Tensor:
    """`empty_host` with the shape and dtype of `tensor`."""
    return empty_host(tensor.shape, tensor.dtype)
