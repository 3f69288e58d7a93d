"""Where one large file of JSON lines is cut so that several workers share it: byte ranges that begin and end
at line boundaries (`.jsonl`) or at frame boundaries (`.jsonl.zst` of several frames).

A plain `.jsonl` of S bytes is cut into S // `target` ranges of about equal size (a file under twice the
target stays whole): each cut moves to just past the next newline, so every range holds whole lines. A zstd
file is cut only where one frame ends and the next begins, since a frame cannot be decompressed from its
middle; the frames are found from their headers and block headers alone, without decompressing anything,
and grouped into ranges holding about `target` bytes of lines (each frame's header records its content
size). A zstd file of one frame (what `zstd` writes by default) and a gzip file (whose members have no index
to find without inflating everything) are read whole, by one worker. Parquet files are shared by row groups
(`ferry.data.formats.parts`).

The cuts depend on the file and `target` alone, never on the number of workers, and reading the ranges in
order gives the file's lines in order: the dataset is the same whoever reads which range.
"""

from __future__ import annotations

import struct
from pathlib import Path

import zstandard

from ferry.config.errors import UserError

SPLIT_BYTES = 16 << 20  # a file of JSON lines is shared among workers in ranges of about this many bytes
_SCAN = 1 << 16
_ZSTD_MAGIC = 0xFD2FB528
_SKIPPABLE_MASK, _SKIPPABLE = 0xFFFFFFF0, 0x184D2A50
_BLOCK_RLE, _BLOCK_RESERVED = 1, 3


def line_ranges(path: Path, target: int) -> list[tuple[int, int]]:
    """[start, end) byte ranges of a JSON-lines file, each of whole lines, about `target` bytes each."""
    size = path.stat().st_size
    pieces = size // target
    if pieces < 2:
        return [(0, size)]
    cuts = [0]
    with path.open("rb") as handle:
        for piece in range(1, pieces):
            cut = _after_newline(handle, max(piece * size // pieces, cuts[-1]))
            if cut >= size:
                break
            if cut > cuts[-1]:
                cuts.append(cut)
    return list(zip(cuts, cuts[1:] + [size]))


def frame_ranges(path: Path, target: int) -> list[tuple[int, int]]:
    """[start, end) byte ranges of a zstd file, each of whole frames holding about `target` bytes of lines (by
    the content size each frame's header records; by its compressed size where a header records none)."""
    frames = zstd_frames(path)
    size = frames[-1][0] if frames else 0
    weights = [content if content >= 0 else end - start for (end, content), start in zip(frames, _starts(frames))]
    total = sum(weights)
    if total // target < 2:
        return [(0, size)]
    cuts, held, left = [0], 0, total
    for (end, _), weight in zip(frames[:-1], weights):
        held += weight
        left -= weight
        if held >= target and left >= target // 2:
            cuts.append(end)
            held = 0
    return list(zip(cuts, cuts[1:] + [size]))


def _starts(frames: list[tuple[int, int]]) -> list[int]:
    return [0] + [end for end, _ in frames[:-1]]


def zstd_frames(path: Path) -> list[tuple[int, int]]:
    """(offset just past it, bytes of content or -1 when its header does not say, 0 for a skippable frame) of
    each frame of a zstd file, from the headers alone."""
    frames: list[tuple[int, int]] = []
    with path.open("rb") as handle:
        size = handle.seek(0, 2)
        offset = 0
        while offset < size:
            handle.seek(offset)
            head = handle.read(18)  # the longest frame header: magic, descriptor, window, dictionary id, size
            if len(head) < 4:
                raise UserError(f"{path}: {size - offset} byte(s) after the last frame are no zstd frame")
            (magic,) = struct.unpack_from("<I", head)
            if magic & _SKIPPABLE_MASK == _SKIPPABLE:
                if len(head) < 8:
                    raise UserError(f"{path}: a skippable frame at byte {offset} is cut short")
                offset, content = offset + 8 + struct.unpack_from("<I", head, 4)[0], 0
            elif magic == _ZSTD_MAGIC:
                offset, content = _frame_end(handle, path, offset, head)
            else:
                raise UserError(f"{path}: no zstd frame starts at byte {offset} (magic {magic:#010x})")
            if offset > size:
                raise UserError(f"{path}: the frame ending at byte {offset} runs past the file's end: it is truncated")
            frames.append((offset, content))
    return frames


def _frame_end(handle, path: Path, offset: int, head: bytes) -> tuple[int, int]:
    """The offset just past the zstd frame at `offset` (its header `head`), and its content size (-1: unknown)."""
    try:
        header = zstandard.frame_header_size(head)
        checksum = zstandard.get_frame_parameters(head).has_checksum
        content = zstandard.frame_content_size(head)
    except zstandard.ZstdError as exc:
        raise UserError(f"{path}: the frame header at byte {offset} is corrupt ({exc})") from None
    position = offset + header
    while True:
        handle.seek(position)
        block = handle.read(3)
        if len(block) < 3:
            raise UserError(f"{path}: the frame at byte {offset} ends inside a block header: it is truncated")
        value = int.from_bytes(block, "little")
        last, kind, length = value & 1, (value >> 1) & 3, value >> 3
        if kind == _BLOCK_RESERVED:
            raise UserError(f"{path}: a block at byte {position} has the reserved type: the file is corrupt")
        position += 3 + (1 if kind == _BLOCK_RLE else length)
        if last:
            return position + (4 if checksum else 0), content


def _after_newline(handle, position: int) -> int:
    """The offset just past the first newline at or after `position` (the file's size when there is none)."""
    handle.seek(position)
    while chunk := handle.read(_SCAN):
        found = chunk.find(b"\n")
        if found >= 0:
            return position + found + 1
        position += len(chunk)
    return position
