"""ferry's dataset writer as the last steps of a datatrove pipeline: datatrove's readers and filters choose the
documents, ferry tokenises them and writes the dataset `ferry data prepare` writes from the same documents.

Two steps, for two executors (the second `depends` on the first):

- `TokenPartsWriter(parts_dir, tokenizer, shard_tokens)` ends a pipeline of readers and filters. Datatrove's
  task `rank` of `world_size` tokenises the documents that reach it, each followed by end-of-text, into one
  part file per source file (the `file_path` a datatrove reader records in each document's metadata) and
  writes them, with `ranked.json` (their token and document counts and sha256, and the sha256 of the texts
  they came from) and the tokenizer, to `parts_dir/rank-NNNNN`, staged and renamed whole: a task datatrove
  runs again writes it again, and a half-written one is never read.
- `DatasetJoiner(parts_dir, output)`, one task, checks that every rank of the first executor wrote with the
  same settings and that no source reached two ranks, orders the parts by source path and then rank, and
  appends them into shards at `output` (`ferry.data.partial.write_joined`, the join of `ferry data merge`).
  Datatrove's readers give rank r the files r, r + N, ... of their sorted listing, so source order is the
  reader's input order, and the dataset is the one one process writes from the same documents in that order.

The manifest's `source_hashes` name each source file with its kept documents' count and text bytes, and the
sha256 of those texts (what was tokenised, since a filter may keep part of a file). The tokenizer is a file
(`tokenizer.json` path) or `byte`, as every ferry task needs: tasks cannot each train one and agree.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from itertools import groupby
from pathlib import Path

import numpy as np

from ferry.config.errors import UserError
from ferry.config.extras import import_extra
from ferry.data.manifest import TOKENIZER_NAME, file_entry, sha256_file
from ferry.data.partial import write_joined
from ferry.data.prepare import PrepareResult
from ferry.data.shards import token_dtype
from ferry.data.staging import read_json, write_json, write_staged
from ferry.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from ferry.data.workers import PartTokens, encode_texts, part_file

RANKED_NAME = "ranked.json"
RANKED_FORMAT = "ferry-datatrove-parts"
RANKED_VERSION = 1
_NO_FILE = ""  # the source of documents whose reader recorded no file_path: ordered by rank alone

_base = import_extra("datatrove.pipeline.base", "datatrove", "the datatrove steps", "datatrove")


def rank_directory(parts_dir: Path, rank: int) -> Path:
    return parts_dir / f"rank-{rank:05d}"


def datatrove_settings(tokenizer: str, shard_tokens: int) -> dict:
    """What every rank and the joined dataset share; a dataset with other settings is not up to date."""
    settings = {"engine": "datatrove", "tokenizer": tokenizer, "shard_tokens": shard_tokens}
    if tokenizer != "byte":
        settings["tokenizer_sha256"] = sha256_file(Path(tokenizer))
    return settings


class TokenPartsWriter(_base.PipelineStep):  # type: ignore[name-defined]  # datatrove, imported as an extra
    """The last step of the tokenising executor: this rank's documents into part files (module docstring)."""

    name = "ferry token parts"
    type = "Tokenizer"

    def __init__(self, parts_dir: str | Path, tokenizer: str = "byte", shard_tokens: int = 16_777_216):
        super().__init__()
        if tokenizer != "byte" and not Path(tokenizer).is_file():
            raise UserError(f"TokenPartsWriter: tokenizer {tokenizer!r}: no such file (byte, or a tokenizer.json path)")
        if shard_tokens < 1:
            raise UserError(f"TokenPartsWriter: shard_tokens must be positive, got {shard_tokens}")
        self.parts_dir = str(parts_dir)
        self.tokenizer = tokenizer
        self.shard_tokens = shard_tokens

    def run(self, data, rank: int = 0, world_size: int = 1) -> Iterator:
        tokenizer = ByteTokenizer() if self.tokenizer == "byte" else load_tokenizer(self.tokenizer)
        dtype = np.dtype(token_dtype(tokenizer))

        def build(staging: Path) -> dict:
            records = []
            for sequence, (source, documents) in enumerate(groupby(data or (), key=_source)):
                records.append(self._write_part(sequence, source, documents, tokenizer, dtype, staging))
            (staging / TOKENIZER_NAME).write_text(tokenizer.to_json(), encoding="utf-8")
            ranked = {
                "format": RANKED_FORMAT,
                "version": RANKED_VERSION,
                "rank": rank,
                "world_size": world_size,
                "settings": datatrove_settings(self.tokenizer, self.shard_tokens),
                "dtype": dtype.name,
                "tokenizer": file_entry(staging / TOKENIZER_NAME),
                "part_files": records,
            }
            write_json(staging / RANKED_NAME, ranked)
            return ranked

        write_staged(rank_directory(Path(self.parts_dir), rank), build)
        yield from ()

    def _write_part(self, sequence: int, source: str, documents, tokenizer: Tokenizer, dtype, staging: Path) -> dict:
        texts_sha256 = hashlib.sha256()

        def texts() -> Iterator[str]:
            for document in documents:
                texts_sha256.update(document.text.encode("utf-8"))
                self.update_doc_stats(document)
                yield document.text

        path = part_file(staging, sequence)
        with open(path, "wb") as out:
            tokens, count, text_bytes, sha256 = encode_texts(texts(), tokenizer, dtype, out.write)
        self.stat_update("tokens", value=tokens, unit="part")
        return {
            "sequence": sequence,
            "source": source,
            "file": path.name,
            "tokens": tokens,
            "documents": count,
            "bytes": text_bytes,
            "sha256": sha256,
            "texts_sha256": texts_sha256.hexdigest(),
        }


class DatasetJoiner(_base.PipelineStep):  # type: ignore[name-defined]  # datatrove, imported as an extra
    """The one task of the joining executor: every rank's parts into the dataset at `output`."""

    name = "ferry dataset join"
    type = "Writer"

    def __init__(self, parts_dir: str | Path, output: str | Path, overwrite: bool = False):
        super().__init__()
        self.parts_dir = str(parts_dir)
        self.output = str(output)
        self.overwrite = overwrite

    def run(self, data, rank: int = 0, world_size: int = 1) -> Iterator:
        if world_size != 1:
            raise UserError(f"DatasetJoiner writes one dataset: run it in an executor of 1 task, not {world_size}")
        join_ranked_parts(Path(self.parts_dir), Path(self.output), self.overwrite)
        yield from ()


def join_ranked_parts(parts_dir: Path, output: Path, overwrite: bool = False) -> PrepareResult:
    """The dataset at `output` from the rank directories the `TokenPartsWriter` tasks wrote to `parts_dir`."""
    directories = sorted(parts_dir.glob("rank-*")) if parts_dir.is_dir() else []
    if not directories:
        raise UserError(f"{parts_dir} holds no rank-NNNNN directory: run the TokenPartsWriter executor first")
    ranked = [(directory, _read_ranked(directory)) for directory in directories]
    first_dir, first = ranked[0]
    for directory, record in ranked[1:]:
        for key in ("settings", "world_size", "dtype"):
            if record[key] != first[key]:
                raise UserError(f"{directory} and {first_dir} are not ranks of one pipeline: their {key} differ")
        if record["tokenizer"]["sha256"] != first["tokenizer"]["sha256"]:
            raise UserError(f"{directory} and {first_dir} were tokenised with different tokenizers")
    missing = sorted(set(range(first["world_size"])) - {record["rank"] for _, record in ranked})
    if missing:
        raise UserError(
            f"rank(s) {', '.join(map(str, missing))} of {first['world_size']} wrote nothing to {parts_dir}: "
            "the tokenising executor has not finished every task"
        )
    parts = sorted(
        (
            (record["source"], rank_record["rank"], record["sequence"], directory, record)
            for directory, rank_record in ranked
            for record in rank_record["part_files"]
        ),
        key=lambda item: item[:3],
    )
    ranks_of: dict[str, set[int]] = {}
    for source, rank, *_ in parts:
        ranks_of.setdefault(source, set()).add(rank)
    shared = [source for source, ranks in ranks_of.items() if source != _NO_FILE and len(ranks) > 1]
    if shared:
        ranks = sorted(ranks_of[shared[0]])
        raise UserError(f"{shared[0]} reached ranks {ranks}: each source must be read by one rank")
    results = [
        PartTokens(
            index,
            source,
            None,
            directory / record["file"],
            record["tokens"],
            record["documents"],
            record["bytes"],
            record["sha256"],
        )
        for index, (source, _, _, directory, record) in enumerate(parts)
    ]
    source_hashes = _source_hashes([record for *_, record in parts])
    if not source_hashes:
        raise UserError(f"no document reached the TokenPartsWriter of any rank in {parts_dir}")
    return write_joined(
        output,
        results,
        source_hashes,
        first["settings"],
        first_dir / TOKENIZER_NAME,
        first["dtype"],
        overwrite,
        [str(parts_dir)],
    )


def _source(document) -> str:
    return str(document.metadata.get("file_path") or _NO_FILE)


def _source_hashes(records: list[dict]) -> list[dict]:
    """One entry per source in order: its documents, text bytes and the sha256 of its texts (as tokenised)."""
    entries: dict[str, dict] = {}
    hashers: dict[str, list[str]] = {}
    for record in records:
        if not record["documents"]:
            continue
        named = record["source"] or "datatrove"
        entry = entries.setdefault(record["source"], {"source": named, "bytes": 0, "documents": 0})
        entry["bytes"] += record["bytes"]
        entry["documents"] += record["documents"]
        hashers.setdefault(record["source"], []).append(record["texts_sha256"])
    for source, entry in entries.items():
        digests = hashers[source]
        entry["sha256"] = digests[0] if len(digests) == 1 else hashlib.sha256("".join(digests).encode()).hexdigest()
    return list(entries.values())


def _read_ranked(directory: Path) -> dict:
    path = directory / RANKED_NAME
    if not path.is_file():
        raise UserError(f"{directory} holds no {RANKED_NAME}: it was not written by a TokenPartsWriter task")
    record = read_json(path)
    if record.get("format") != RANKED_FORMAT or record.get("version") != RANKED_VERSION:
        raise UserError(f"{path} is not a {RANKED_FORMAT} v{RANKED_VERSION} record")
    return record
