"""Names and helpers shared by the writer and the reader of token datasets."""

from __future__ import annotations

import hashlib
from pathlib import Path

DATASET_FORMAT = "ferry-token-dataset"
DATASET_VERSION = 1
MANIFEST_NAME = "manifest.json"
TOKENIZER_NAME = "tokenizer.json"


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()
