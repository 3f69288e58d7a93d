"""Names and helpers shared by the writers and the readers of datasets (token streams and records)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from ferry.config.errors import UserError

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


_READERS = {"preferences": "train.objective: dpo", "prompts": "train.objective: grpo"}


def record_kind(manifest: dict) -> str | None:
    """`preferences` or `prompts` for a record dataset's manifest, None for a token stream."""
    records = manifest.get("records")
    return records["kind"] if isinstance(records, dict) else None


def refuse_records(manifest: dict, label: str, reader: str) -> None:
    """A token-stream reader given a record dataset: say which objective reads it."""
    kind = record_kind(manifest)
    if kind is not None:
        raise UserError(f"{label} holds {kind} (a record dataset), which {reader} cannot read; {_READERS[kind]} does")
