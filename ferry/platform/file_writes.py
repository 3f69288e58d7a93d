"""Writing a file once, in pieces each hashed as it goes out, past the page cache where the filesystem allows.

A checkpoint's tensor files are written once and read, if ever, by a restart. Through the page cache every byte
first needs a free page of memory, and the cache fills with bytes nobody reads soon. On the virtual machine the
checkpoint benchmarks ran on, filling it cost a 1 GB save 0.9-1.5 core-seconds in the kernel: the save ran at
0.4-0.5 GB/s through the page cache where the same disk took it at 1.7-2.0 past it (docs/performance.md,
"Checkpoint I/O").
Past the cache (`O_DIRECT`), the bytes go from two small aligned buffers, reused for every piece, to the device:
while a helper thread writes one (the write blocks until the device has the bytes), the caller copies and hashes
the next piece into the other, so the device is kept busy while the CPU hashes.

`O_DIRECT` wants the buffer, the file offset and the length aligned to the device's logical block; the buffers
here are page-aligned (an anonymous map), every piece but the last is a multiple of `BLOCK_BYTES`, and the last
is padded to a block and the file then truncated to its true length. Where the OS has no `O_DIRECT` or the
filesystem refuses it (tmpfs before Linux 6.6, some network filesystems), the file is written through the page
cache instead, in pieces of the same size; either way it is fsynced before `finish` returns. A file being
written past the cache holds its two buffers, 16 MiB, until it is closed.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ferry.platform.digests import Digests

BLOCK_BYTES = 4096  # a multiple of every logical block size O_DIRECT may ask to be aligned to
PIECE_BYTES = 8 << 20  # one piece copied, hashed and written: small enough to stay in cache between the three
_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP)  # what a filesystem without O_DIRECT answers


class HashedFileWriter:
    """A new file at `path`, written by `write` calls in order and made durable by `finish`; every byte written
    is fed to `digests` once, in order.

    `direct`: past the page cache where the OS and the filesystem allow (`self.direct` says whether it was).
    """

    def __init__(self, path: Path, digests: Digests, direct: bool = True):
        self._digests = digests
        self._size = 0
        self._descriptor = _open_direct(path) if direct else None
        self.direct = self._staged = self._descriptor is not None  # `direct` turns false if the first write is refused
        if not self._staged:
            self._descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
            return
        try:
            self._buffers = [mmap.mmap(-1, PIECE_BYTES) for _ in range(2)]
            self._views = [memoryview(buffer) for buffer in self._buffers]
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="direct-write")
        except BaseException:
            os.close(self._descriptor)
            raise
        self._writes: list[Future | None] = [None, None]  # each buffer's write in flight
        self._current = 0  # the buffer being filled
        self._filled = 0

    def write(self, data) -> None:
        """Append `data` (anything with the buffer protocol, contiguous) to the file."""
        data = memoryview(data).cast("B")
        if self._staged:
            self._stage(data)
            return
        for start in range(0, len(data), PIECE_BYTES):
            piece = data[start : start + PIECE_BYTES]
            _write_all(self._descriptor, piece, self._size)
            self._digests.update(piece)
            self._size += len(piece)

    def finish(self) -> int:
        """Write what is staged, fsync, and return the file's length in bytes."""
        if self._staged:
            if self._filled:
                self._drain()
            for write in self._writes:
                if write is not None:
                    write.result()
            os.ftruncate(self._descriptor, self._size)
        os.fsync(self._descriptor)
        return self._size

    def close(self) -> None:
        """Close the file; a write still in flight (the caller failed mid-file) is waited for first, one queued
        behind it dropped. The buffers are unmapped when the last reference goes (a failed write's traceback may
        still hold a slice)."""
        if self._staged:
            self._writer.shutdown(wait=True, cancel_futures=True)
            self._views = self._buffers = []
        os.close(self._descriptor)

    def __enter__(self) -> HashedFileWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _stage(self, data: memoryview) -> None:
        """Copy `data` into the buffer being filled, writing it out each time it fills."""
        while len(data):
            view = self._views[self._current]
            if not self._filled and self._writes[self._current] is not None:
                self._writes[self._current].result()  # its previous piece must be on the device before reuse
            take = min(len(data), PIECE_BYTES - self._filled)
            view[self._filled : self._filled + take] = data[:take]
            self._filled += take
            data = data[take:]
            if self._filled == PIECE_BYTES:
                self._drain()

    def _drain(self) -> None:
        """Hash the filled buffer and hand it to the helper to write at its offset, then fill the other one.

        Only the file's last piece is ever padded to a block (`finish` truncates the padding away). The first
        piece is written by the caller: a filesystem that took O_DIRECT at open but refuses its writes is then
        written through the page cache, before any other write is in flight.
        """
        view, filled, offset = self._views[self._current], self._filled, self._size
        self._digests.update(view[:filled])
        padded = -(-filled // BLOCK_BYTES) * BLOCK_BYTES
        view[filled:padded] = bytes(padded - filled)
        if offset:
            self._writes[self._current] = self._writer.submit(_write_all, self._descriptor, view[:padded], offset)
        else:
            self._write_first(view[:padded])
        self._size += filled
        self._filled = 0
        self._current = 1 - self._current

    def _write_first(self, piece: memoryview) -> None:
        try:
            _write_all(self._descriptor, piece, 0)
        except OSError as exc:
            if exc.errno not in _REFUSED:
                raise
            flags = fcntl.fcntl(self._descriptor, fcntl.F_GETFL)
            fcntl.fcntl(self._descriptor, fcntl.F_SETFL, flags & ~os.O_DIRECT)
            self.direct = False
            _write_all(self._descriptor, piece, 0)


def _open_direct(path: Path) -> int | None:
    """A descriptor for a new file at `path` that writes past the page cache, or None where that is refused."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | flag, 0o666)
    except OSError as exc:
        if exc.errno in _REFUSED:
            return None
        raise


def _write_all(descriptor: int, data: memoryview, offset: int) -> None:
    """`os.pwrite` `data` at `offset` until all of it is written (a write may take less than it is given)."""
    while len(data):
        written = os.pwrite(descriptor, data, offset)
        data = data[written:]
        offset += written
