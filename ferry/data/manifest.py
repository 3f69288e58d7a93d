"""Names and helpers shared by the writers and the readers of datasets (token streams and records)."""

from __future__ import annotations

from pathlib import Path

from ferry.config.errors import UserError
from ferry.platform.digests import digest_file

DATASET_FORMAT = "ferry-token-dataset"
DATASET_VERSION = 1
MANIFEST_NAME = "manifest.json"
TOKENIZER_NAME = "tokenizer.json"


def sha256_file(path: Path) -> str:
    return digest_file(path, ("sha256",))["sha256"]


def file_entry(path: Path, **fields) -> dict:
    """What a manifest records of a file it names: its name, `fields`, its size in bytes (checked by a `stat`
    alone, `ferry data verify --sample`), and its sha256 and xxh3-128."""
    return {"file": path.name, **fields, "bytes": path.stat().st_size, **digest_file(path)}


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
