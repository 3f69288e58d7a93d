"""Tokenising the parts of a text corpus (`ferry.data.formats.Part`: a file, or one Parquet row group) in
worker processes, with a dataset that does not depend on how many there are.

A worker writes each part's token stream (every document followed by end-of-text, in the dataset's
dtype) to a part file of its own; the caller takes the part files back in input order, whichever worker
finished first, and appends them to the shard writer. So the stream, its shards and their digests are
those of one process reading the parts in order. At most `2 * workers` parts are read ahead, and a part
file is deleted once taken, so memory holds one batch of documents per worker and the disk holds a few
parts beside the dataset. Workers fork from a `forkserver` (`spawn` where there is none): no copy of the
caller's threads or tensors; and encode on one thread each: N workers use N cores.

A worker's error (a malformed line or row) reaches the caller as it was raised, naming the file and the
line or row; the other workers stop at their next batch.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np

from ferry.config.errors import UserError
from ferry.data.formats import Part, no_documents, read_texts
from ferry.data.tokenizer import Tokenizer, encode_documents, tokenizer_from_json

ENCODE_BATCH = 256
_READ_TOKENS = 1 << 22  # tokens read back from a part file at a time
_LOOK_AHEAD = 2  # parts in flight per worker: one being read, one waiting to be taken


@dataclass(frozen=True)
class PartTokens:
    """What tokenising part `index` made: its part file and the counts the manifest records of its source
    (`text_bytes`: the UTF-8 bytes of its documents' text)."""

    index: int
    source: str
    row_group: int | None
    path: Path
    tokens: int
    documents: int
    text_bytes: int
    sha256: str

    def as_record(self) -> dict:
        return {
            "index": self.index,
            "source": self.source,
            "row_group": self.row_group,
            "file": self.path.name,
            "tokens": self.tokens,
            "documents": self.documents,
            "bytes": self.text_bytes,
            "sha256": self.sha256,
        }


def part_file(directory: Path, index: int) -> Path:
    return directory / f"part-{index:06d}.tokens"


def tokenize_parts(
    parts: list[tuple[int, Part]],
    tokenizer: Tokenizer,
    text_field: str,
    dtype: np.dtype,
    directory: Path,
    workers: int | None,
) -> Iterator[PartTokens]:
    """The (index, part) pairs tokenised into part files in `directory`, yielded in the order given:
    in this process with `workers` None, else by that many worker processes."""
    if workers is None:
        for index, part in parts:
            yield tokenize_part(index, part, tokenizer, text_field, dtype, part_file(directory, index))
        return
    context = _worker_context()
    stop = context.Event()
    initargs = (tokenizer.to_json(), text_field, np.dtype(dtype).name, stop)
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker, initargs=initargs) as pool:
        waiting = iter(parts)
        pending: deque[tuple[Part, Future]] = deque()

        def submit(count: int) -> None:
            for index, part in islice(waiting, count):
                pending.append((part, pool.submit(_tokenize_in_worker, index, part, part_file(directory, index))))

        try:
            submit(_LOOK_AHEAD * workers)
            while pending:
                part, future = pending.popleft()
                try:
                    result = future.result()
                except BrokenProcessPool:
                    raise UserError(
                        f"a tokenising worker died while {part.path} was read (killed, or out of memory?); "
                        "try fewer --workers"
                    ) from None
                submit(1)
                yield result
        except BaseException:  # an error, or the caller stopped reading: workers end at their next batch
            stop.set()
            for _, future in pending:
                future.cancel()
            raise


def tokenize_part(
    index: int, part: Part, tokenizer: Tokenizer, text_field: str, dtype: np.dtype, path: Path, stop=None
) -> PartTokens:
    """Write the token stream of one part to `path`; `stop` (an event) ends the work between batches."""
    with open(path, "wb") as out:
        counts = encode_part(part, tokenizer, text_field, dtype, out.write, stop)
    return PartTokens(index, str(part.path), part.row_group, path, *counts)


def encode_part(
    part: Part, tokenizer: Tokenizer, text_field: str, dtype: np.dtype, write: Callable[[bytes], object], stop=None
) -> tuple[int, int, int, str]:
    """Pass the token stream of one part to `write`; (tokens, documents, text bytes, sha256 of the stream)."""
    return encode_texts((document.text for document in read_texts(part, text_field)), tokenizer, dtype, write, stop)


def encode_texts(
    texts: Iterator[str], tokenizer: Tokenizer, dtype: np.dtype, write: Callable[[bytes], object], stop=None
) -> tuple[int, int, int, str]:
    """Pass the token stream of `texts` (each followed by end-of-text) to `write`, a batch of documents at a
    time; (tokens, documents, text bytes, sha256 of the stream). `stop` (an event) ends the work between
    batches."""
    hasher = hashlib.sha256()
    tokens = documents = text_bytes = 0
    eos = np.asarray([tokenizer.eos_id], dtype=np.int64)
    while batch := list(islice(texts, ENCODE_BATCH)):
        if stop is not None and stop.is_set():
            raise _Stopped
        pieces: list[np.ndarray] = []
        for ids in encode_documents(tokenizer, batch):
            pieces += (ids, eos)
        data = np.concatenate(pieces).astype(dtype).tobytes()
        write(data)
        hasher.update(data)
        tokens += len(data) // np.dtype(dtype).itemsize
        documents += len(batch)
        text_bytes += sum(len(text.encode("utf-8")) for text in batch)
    return tokens, documents, text_bytes, hasher.hexdigest()


def read_part_file(path: Path, dtype: np.dtype, tokens: int, sha256: str) -> Iterator[np.ndarray]:
    """The tokens of a part file in slices of bounded size, checked against its recorded count and sha256."""
    hasher = hashlib.sha256()
    seen = 0
    with open(path, "rb") as handle:
        while (chunk := np.fromfile(handle, dtype=dtype, count=_READ_TOKENS)).size:
            hasher.update(chunk.tobytes())
            seen += chunk.size
            yield chunk
    if seen != tokens or hasher.hexdigest() != sha256:
        raise UserError(f"{path} does not match what its task recorded (tokens or sha256): it was changed or cut short")


def source_entries(results: list[PartTokens] | Iterator[PartTokens], file_sha256: dict[str, str]) -> list[dict]:
    """The manifest's `source_hashes` from the parts in input order: one entry per source that gave a
    document, in the order of its first document, as a single pass over the documents records them."""
    by_source: dict[str, dict] = {}
    for result in results:
        if not result.documents:
            continue
        entry = by_source.setdefault(result.source, {"source": result.source, "bytes": 0, "documents": 0})
        entry["bytes"] += result.text_bytes
        entry["documents"] += result.documents
    for source, entry in by_source.items():
        entry["sha256"] = file_sha256[source]
    if not by_source:
        raise UserError(no_documents([Path(source) for source in file_sha256]))
    return list(by_source.values())


def _worker_context() -> multiprocessing.context.BaseContext:
    """forkserver where there is one: workers fork from a clean server process that imported this module
    once (no copy of the caller's threads, and one import, not one per worker); spawn elsewhere."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


class _Stopped(Exception):
    """Another part failed; this one's work is no longer wanted."""


_worker: dict = {}


def _start_worker(tokenizer_json: str, text_field: str, dtype: str, stop) -> None:
    # one encoding thread per worker: N workers are N cores, not N times the tokenizer's thread pool
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker.update(
        tokenizer=tokenizer_from_json(tokenizer_json, "the prepared dataset's tokenizer"),
        text_field=text_field,
        dtype=np.dtype(dtype),
        stop=stop,
    )


def _tokenize_in_worker(index: int, part: Part, path: Path) -> PartTokens:
    return tokenize_part(
        index, part, _worker["tokenizer"], _worker["text_field"], _worker["dtype"], path, _worker["stop"]
    )
