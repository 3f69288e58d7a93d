"""Checking a dataset's files against its manifest, before a run reads them and with `ferry data verify`.

A manifest records the sha256 and the xxh3-128 of every file it names (token and loss-mask shards, record
files, the tokenizer); datasets written before the xxh3-128 was recorded hold the sha256 alone. A reader
checks one of them (`data.verify`) before it reads any token: a flipped bit in a shard would otherwise be
trained on silently, under a run record that names the shard's digest as if it had been read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from ferry.config.errors import UserError
from ferry.data.manifest import DATASET_FORMAT, DATASET_VERSION, MANIFEST_NAME
from ferry.platform.digests import RECORDED, digest_file

DataVerification = Literal["xxh3_128", "sha256", "none"]


class DatasetMismatch(UserError):
    """A file of a prepared dataset is not the one its manifest names (changed, cut short or gone)."""

    def __init__(self, message: str, path: Path):
        super().__init__(message)
        self.path = path


def named_files(manifest: dict) -> list[dict]:
    """Every file entry a dataset manifest names that records a digest: shards, loss-mask shards, record files,
    the tokenizer."""
    entries = list(manifest.get("shards", []))
    entries += manifest.get("loss_mask", {}).get("shards", [])
    records = manifest.get("records")
    if isinstance(records, dict):
        entries += records.get("files", [])
    tokenizer = manifest.get("tokenizer", {})
    if tokenizer.get("file"):
        entries.append(tokenizer)
    return entries


def verify_files(directory: Path, manifest: dict, label: str, digest: DataVerification) -> str | None:
    """Check every file the manifest names against its recorded `digest` (the sha256 of an entry that records
    no xxh3-128); the digests checked (`xxh3_128`; `sha256` too, where older entries record only that), or None
    for `none`."""
    if digest == "none":
        return None
    used: set[str] = set()
    for entry in named_files(manifest):
        name = digest if digest in entry else "sha256"
        _check(directory, entry, (name,), label)
        used.add(name)
    return "+".join(sorted(used)) or digest


def verify_dataset(path: Path) -> str:
    """One line saying that every file of the dataset at `path` matches every digest its manifest records;
    `DatasetMismatch` names the first that does not (a `UserError` when `path` is no dataset)."""
    manifest_path = path / MANIFEST_NAME
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{str(path)!r} is not a prepared dataset (no {MANIFEST_NAME})") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"{str(manifest_path)!r} is unreadable: {exc}") from None
    if not isinstance(manifest, dict) or (manifest.get("format"), manifest.get("version")) != (
        DATASET_FORMAT,
        DATASET_VERSION,
    ):
        raise UserError(f"{str(manifest_path)!r} is not a {DATASET_FORMAT} v{DATASET_VERSION} manifest")
    entries = named_files(manifest)
    checked: set[str] = set()
    total = 0
    for entry in entries:
        names = tuple(name for name in RECORDED if name in entry)
        _check(path, entry, names, f"dataset {path}")
        checked.update(names)
        total += (path / entry["file"]).stat().st_size
    return (
        f"ferry: dataset {path} is valid — {len(entries)} files ({total:,} bytes), every file's "
        f"{' and '.join(sorted(checked))} match"
    )


def _check(directory: Path, entry: dict, names: tuple[str, ...], label: str) -> None:
    path = directory / entry["file"]
    try:
        found = digest_file(path, names)
    except OSError as exc:
        raise DatasetMismatch(f"{label}: {str(path)!r} cannot be read: {exc}", path) from None
    for name in names:
        if found[name] != entry[name]:
            raise DatasetMismatch(
                f"{label}: {str(path)!r} is not the file its manifest names ({name} {found[name]}, the manifest "
                f"records {entry[name]}): it changed after `ferry data prepare` wrote it; prepare the dataset "
                "again (a run with data.verify: none reads its training sources as they are)",
                path,
            )
