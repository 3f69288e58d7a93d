"""The digests a checkpoint records for each file, several of them computed in one pass over the bytes.

Every manifest records each file's sha256, which any tool can check (`sha256sum`), and its
xxh3-128, which is what a resume checks by default (`checkpoint.verify`). Both find a corrupt or
truncated file (a 128-bit digest misses a random change with probability 2^-128), but xxh3 runs at
7-11 GB/s on one core where sha256 runs at 1.3-1.4 (with SHA instructions), so checking every byte
no longer dominates the time to resume. xxh3 is not built to resist a forger; sha256 is, but only
helps against one whose hands cannot reach the manifest: where it is kept out of their reach, set
`checkpoint.verify: sha256`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import xxhash

DIGESTS = {"sha256": hashlib.sha256, "xxh3_128": xxhash.xxh3_128}
RECORDED = tuple(DIGESTS)  # every save records all of them
FAST = "xxh3_128"


class Digests:
    """Several digests of one stream of bytes, updated together so the bytes are read once."""

    def __init__(self, names: Iterable[str]):
        self._hashers = {name: DIGESTS[name]() for name in names}

    def update(self, data) -> None:
        for hasher in self._hashers.values():
            hasher.update(data)

    def hexdigests(self) -> dict[str, str]:
        return {name: hasher.hexdigest() for name, hasher in self._hashers.items()}


def checkpoint_digest(path: Path) -> str:
    """The sha256 of a checkpoint's manifest, which names the digest of every file: one value for the whole
    checkpoint (a stage's parent in a lineage, the key of a cached reference)."""
    from ferry.checkpoint.format import MANIFEST_NAME

    return hashlib.sha256((Path(path) / MANIFEST_NAME).read_bytes()).hexdigest()
