"""Reading a safetensors file's tensors by byte range, straight into caller-owned memory.

The safetensors library copies a tensor into memory of its own; a resume that must
fill fresh optimizer state (or live parameters) would then pay a second copy and twice
the page faults. Here a tensor's bytes go from the file into their final memory with
one `preadv`, and `hash_and_fill` does so while it computes the file's digests.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from ferry.checkpoint.format import CheckpointError
from ferry.platform.digests import Digests, digest_file

HASHED_READ_BYTES = 8 << 20  # a piece read and hashed at once: small enough to stay in cache between the two


class TensorFile:
    """Positional reads of a verified safetensors file's tensors into caller-owned memory.

    The header (a little-endian u64 length, then JSON with each tensor's byte range
    after it) was already checked against the manifest by the safetensors library in
    `verify_checkpoint`; here it only gives the byte ranges. Each read opens the file
    for itself: a reader holding many parts (a rank resharding from many ranks' files)
    keeps no descriptors open between reads.
    """

    def __init__(self, path: Path):
        self.path = path
        with _opened(path) as descriptor:
            self._ranges = _byte_ranges(descriptor, path)

    def read_into(self, name: str, out: torch.Tensor) -> None:
        with _opened(self.path) as descriptor:
            _pread_exactly(descriptor, self.path, name, self._ranges[name], out)


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[int]:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        yield descriptor
    finally:
        os.close(descriptor)


def _byte_ranges(descriptor: int, path: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's [start, end) in the file, from its safetensors header (a u64 length, then JSON)."""
    try:
        (length,) = struct.unpack("<Q", os.pread(descriptor, 8, 0))
        if length > os.fstat(descriptor).st_size - 8:
            raise ValueError(f"a header of {length} bytes does not fit in the file")
        header = json.loads(os.pread(descriptor, length, 8))
        start = 8 + length
        return {
            key: (start + int(value["data_offsets"][0]), start + int(value["data_offsets"][1]))
            for key, value in header.items()
            if key != "__metadata__"
        }
    except (struct.error, ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError) as exc:
        raise CheckpointError(f"{path} has an unreadable safetensors header: {exc!r}") from None


def _pread_exactly(
    descriptor: int, path: Path, name: str, byte_range: tuple[int, int], out: torch.Tensor | memoryview
) -> None:
    """Read the bytes of tensor `name` (or of a piece of it) straight into `out`'s memory."""
    start, end = byte_range
    view = out if isinstance(out, memoryview) else bytes_of(out)
    if end - start != len(view):
        raise CheckpointError(f"{path}: {name} holds {end - start} bytes, {len(view)} expected")
    done = 0
    while done < len(view):
        count = os.preadv(descriptor, [view[done:]], start + done)
        if count == 0:
            raise CheckpointError(f"{path} ends inside {name}")
        done += count


def bytes_of(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes where they lie (no copy): its memory as the file holds it (contiguous, host memory)."""
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def hash_and_fill(path: Path, targets: dict[str, torch.Tensor], names: Iterable[str]) -> dict[str, str]:
    """The file's digests `names`, reading the tensors named in `targets` into them on the way.

    The digest covers the file's bytes in order: the stretches between targets come
    from a memory map of the file, each target's bytes from the memory they were just
    read into. A header whose ranges overlap or run past the end of the file is refused.
    """
    if not targets:
        return digest_file(path, names)
    digest = Digests(names)
    with _opened(path) as descriptor:
        if hasattr(os, "posix_fadvise"):  # start reading the whole file ahead of the hash
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_WILLNEED)
        ranges = _byte_ranges(descriptor, path)
        missing = sorted(set(targets) - set(ranges))
        if missing:
            raise CheckpointError(f"{path} does not hold {', '.join(missing[:5])}, which the manifest puts there")
        size = os.fstat(descriptor).st_size
        with mmap.mmap(descriptor, size, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as whole:
            position = 0
            for name in sorted(targets, key=lambda key: ranges[key]):
                start, end = ranges[name]
                if not position <= start <= end <= size:
                    raise CheckpointError(f"{path}: the header puts {name} at bytes {start}-{end}: not possible")
                digest.update(whole[position:start])
                if end - start != targets[name].nbytes:
                    raise CheckpointError(f"{path}: {name} holds {end - start} bytes, {targets[name].nbytes} expected")
                view = bytes_of(targets[name])
                for offset in range(0, len(view), HASHED_READ_BYTES):  # each piece hashed while still in cache
                    piece = view[offset : offset + HASHED_READ_BYTES]
                    _pread_exactly(descriptor, path, name, (start + offset, start + offset + len(piece)), piece)
                    digest.update(piece)
                position = end
            digest.update(whole[position:])
    return digest.hexdigests()


def is_plain_cpu(tensor: torch.Tensor, stored_dtype: str) -> bool:
    """Whether the bytes as stored can go straight into `tensor`'s memory."""
    return (
        tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and str(tensor.dtype).removeprefix("torch.") == stored_dtype
    )
