"""The host allocator preset of a CPU run: memory a step frees stays in the process for the next step.

glibc hands blocks above its mmap threshold (128 KiB, growing to at most 32 MiB) back to the kernel
when they are freed, and trims the top of its heap; a training step frees and allocates the same large
buffers every step (the logits and their gradient, attention's buffers, the norms' outputs), so every
step maps them afresh and pays a page fault per 4 KiB page on first touch (1.6-2.7 us on the
development VMs). With no mmap and no trimming, the freed blocks are reused: on the whole-step
benchmark (docs/performance.md) minor faults fall from ~80,000 a step to ~2,000 and the step runs
faster. The memory a run holds on to is what its largest step needed anyway. Reuse is not certain:
torch allocates 64-byte aligned blocks, and a freed block that a small allocation now borders is taken
again only by a request that still fits it; in a process that interleaves other large models (the
benchmark's transformers side) ~60,000 faults a step remained.

Set in the process with `mallopt`, so it holds for every rank whatever started it (`ferry train`,
`--nproc`, torchrun, a scheduler); other programs get the same from the environment, before they start:
`MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Literal

HostAllocator = Literal["default", "keep_freed"]

# mallopt parameters, from glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt takes an int: the largest, i.e. never trim
SETTINGS = {"M_MMAP_MAX": 0, "M_TRIM_THRESHOLD": TRIM_THRESHOLD_BYTES}


def apply_host_allocator(preset: HostAllocator) -> dict:
    """Apply `preset` to this process's C allocator; what run.json records (applied or why not)."""
    if preset == "default":
        return {"preset": preset, "applied": False}
    path = ctypes.util.find_library("c")
    libc = ctypes.CDLL(path) if path else None
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return {"preset": preset, "applied": False, "reason": "the C library is not glibc (no mallopt)"}
    libc.gnu_get_libc_version.restype = ctypes.c_char_p
    accepted = libc.mallopt(M_MMAP_MAX, SETTINGS["M_MMAP_MAX"]) and libc.mallopt(
        M_TRIM_THRESHOLD, SETTINGS["M_TRIM_THRESHOLD"]
    )
    record = {"preset": preset, "applied": bool(accepted), "glibc": libc.gnu_get_libc_version().decode()}
    if accepted:
        return {**record, "mallopt": dict(SETTINGS)}
    return {**record, "reason": "mallopt refused the settings"}
