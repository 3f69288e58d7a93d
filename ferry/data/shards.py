"""Token ids into a dataset's files: `.npy` shards of a bounded number of tokens, the dtype that holds the
vocabulary, and the manifest that names every file with its digests. `ferry data prepare` writes through them in
one process or many (`workers.py`), and `ferry data merge` when it joins the parts of many tasks (`partial.py`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ferry.data.manifest import DATASET_FORMAT, DATASET_VERSION, TOKENIZER_NAME, file_entry
from ferry.data.tokenizer import Tokenizer


def token_dtype(tokenizer: Tokenizer) -> type:
    return np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32


def token_manifest(tokenizer: Tokenizer, staging: Path, writer: ShardWriter, document_count: int) -> dict:
    """The manifest of a finished dataset (written with its tokenizer into `staging`)."""
    (staging / TOKENIZER_NAME).write_text(tokenizer.to_json(), encoding="utf-8")
    return {
        "format": DATASET_FORMAT,
        "version": DATASET_VERSION,
        "tokenizer": tokenizer_record(tokenizer, staging),
        "dtype": np.dtype(writer.dtype).name,
        "documents": document_count,
        "total_tokens": writer.total_tokens,
        "shards": writer.shards,
    }


def tokenizer_record(tokenizer: Tokenizer, staging: Path) -> dict:
    return {
        "kind": tokenizer.kind,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        **file_entry(staging / TOKENIZER_NAME),
    }


class ShardWriter:
    """Appends token ids and cuts them into `.npy` shards of `shard_tokens` tokens."""

    def __init__(self, directory: Path, dtype: type, shard_tokens: int, prefix: str = "shard"):
        self.directory = directory
        self.prefix = prefix
        self.dtype = dtype
        self.shard_tokens = shard_tokens
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.total_tokens = 0
        self.shards: list[dict] = []

    def add(self, ids: np.ndarray) -> None:
        self.pending.append(ids.astype(self.dtype, copy=False))
        self.pending_tokens += len(ids)
        while self.pending_tokens >= self.shard_tokens:
            stream = np.concatenate(self.pending)
            self._flush(stream[: self.shard_tokens])
            rest = stream[self.shard_tokens :]
            self.pending = [rest]
            self.pending_tokens = len(rest)

    def close(self) -> None:
        if self.pending_tokens:
            self._flush(np.concatenate(self.pending))
        self.pending = []
        self.pending_tokens = 0

    def _flush(self, tokens: np.ndarray) -> None:
        name = f"{self.prefix}-{len(self.shards):05d}.npy"
        path = self.directory / name
        np.save(path, tokens)
        self.shards.append(file_entry(path, tokens=int(len(tokens))))
        self.total_tokens += int(len(tokens))
