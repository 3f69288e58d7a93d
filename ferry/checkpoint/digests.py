"""The digests a checkpoint records for each file (`ferry.platform.digests`), and the one that names it whole.

Every manifest records each file's sha256 and its xxh3-128; a resume checks the one `checkpoint.verify`
names (xxh3-128 by default: where the manifest is kept out of a forger's reach, set `sha256`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ferry.platform.digests import DIGESTS, FAST, RECORDED, Digests

__all__ = ["DIGESTS", "FAST", "RECORDED", "Digests", "checkpoint_digest"]


def checkpoint_digest(path: Path) -> str:
    """The sha256 of a checkpoint's manifest, which names the digest of every file: one value for the whole
    checkpoint (a stage's parent in a lineage, the key of a cached reference)."""
    from ferry.checkpoint.format import MANIFEST_NAME

    return hashlib.sha256((Path(path) / MANIFEST_NAME).read_bytes()).hexdigest()
