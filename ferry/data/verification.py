"""Checking a dataset's files against its manifest, before a run reads them and with `ferry data verify`.

A manifest records the sha256 and the xxh3-128 of every file it names (token and loss-mask shards, record
files, the tokenizer); datasets written before the xxh3-128 was recorded hold the sha256 alone. A reader
checks one of them (`data.verify`) before it reads any token: a flipped bit in a shard would otherwise be
trained on silently, under a run record that names the shard's digest as if it had been read. A small set is
checked whole before a run starts; a large one shard by shard as each is first read (`TokenDataset`), so a run
over 10,000 shards does not read them all to start. `ferry data verify` checks every file, or with `--sample K`
a seeded subset of the data files (the seed printed, so a failure can be repeated) and every file's size.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

import xxhash

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
    for entry in named_files(manifest):
        verify_entry(directory, entry, label, digest)
    return digests_checked(manifest, digest)


def digests_checked(manifest: dict, digest: DataVerification) -> str | None:
    """What checking the manifest's files with `digest` checks: `digest`, and `sha256` too where older entries
    record only that; None for `none`."""
    if digest == "none":
        return None
    used = {digest if digest in entry else "sha256" for entry in named_files(manifest)}
    return "+".join(sorted(used)) or digest


def verify_entry(directory: Path, entry: dict, label: str, digest: str) -> None:
    """Check one file against its recorded `digest` (its sha256 where the entry records no such digest)."""
    _check(directory, entry, (digest if digest in entry else "sha256",), label)


def sample_size(text: str) -> float | int:
    """`--sample`'s value: a count of files (an integer, at least 1) or a fraction of them (in (0, 1])."""
    try:
        value: float | int = int(text)
        valid = value >= 1
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        valid = 0.0 < value <= 1.0
    if not valid:
        raise UserError(f"--sample {text}: give a number of files (at least 1) or a fraction in (0, 1]")
    return value


def sampled(entries: list[dict], size: float | int, seed: int) -> list[dict]:
    """`size` of `entries` (a count, or a fraction rounded up), chosen by `seed` alone: each file is ranked by
    the xxh3-64 of the seed and its name, so the same seed picks the same files on any machine and any version
    of Python or numpy; kept in manifest order."""
    count = min(len(entries), size if isinstance(size, int) else math.ceil(round(size * len(entries), 9)))
    rank = [xxhash.xxh3_64_intdigest(f"{seed}:{entry['file']}".encode()) for entry in entries]
    chosen = sorted(range(len(entries)), key=rank.__getitem__)[:count]
    return [entries[i] for i in sorted(chosen)]


def read_manifest(path: Path) -> dict:
    """The manifest of the dataset at `path`; a `UserError` when `path` holds no dataset ferry can read."""
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
    return manifest


def verify_dataset(path: Path) -> str:
    """One line saying that every file of the dataset at `path` matches every digest its manifest records;
    `DatasetMismatch` names the first that does not (a `UserError` when `path` is no dataset)."""
    entries = named_files(read_manifest(path))
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


def verify_sample(path: Path, size: float | int, seed: int) -> str:
    """`verify_dataset` on a seeded sample of the data files (token and loss-mask shards, record files), with
    the tokenizer always checked and every file's presence and size: a quick check of a huge set, repeatable
    with the seed the line names."""
    manifest = read_manifest(path)
    entries = named_files(manifest)
    tokenizer = [entry for entry in entries if entry is manifest.get("tokenizer")]
    data = [entry for entry in entries if entry is not manifest.get("tokenizer")]
    label = f"dataset {path}"
    for entry in entries:
        check_size(path, entry, label)
    chosen = sampled(data, size, seed)
    checked: set[str] = set()
    total = 0
    for entry in tokenizer + chosen:
        names = tuple(name for name in RECORDED if name in entry)
        _check(path, entry, names, label)
        checked.update(names)
        total += (path / entry["file"]).stat().st_size
    sizes = ", of the size its manifest records" if all("bytes" in entry for entry in entries) else ""
    return (
        f"ferry: dataset {path} is valid in the sample — {len(chosen)} of {len(data)} data files (seed {seed}; "
        f"`--sample {len(chosen)} --seed {seed}` checks the same ones){' and the tokenizer' if tokenizer else ''}, "
        f"{total:,} bytes, every checked file's {' and '.join(sorted(checked))} match; every file present{sizes}"
    )


def check_size(directory: Path, entry: dict, label: str) -> None:
    """A file the manifest names is there and, where the entry records its size (`bytes`), of that size:
    a missing or cut-short file found by a `stat`, without reading it."""
    path = directory / entry["file"]
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise DatasetMismatch(f"{label}: {str(path)!r} cannot be read: {exc}", path) from None
    if "bytes" in entry and size != entry["bytes"]:
        raise DatasetMismatch(
            f"{label}: {str(path)!r} holds {size:,} bytes, its manifest records {entry['bytes']:,}: it changed "
            "after `ferry data prepare` wrote it (cut short or replaced); prepare the dataset again",
            path,
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
