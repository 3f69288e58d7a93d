"""Synthetic token datasets: the same token values on every machine, from a seed alone.

A benchmark that compares hardware must feed every machine identical tensors: kernel
time depends on the values (through the router, on which experts receive how many
tokens), not only on the shapes. Tokens here follow a Zipf law over the vocabulary,
as text does, so the expert loads are as uneven as they are in training, and they are
drawn from the raw output of the PCG64 bit generator through an inverse-CDF lookup in
float64, which no library version, device or world size changes. The dataset is
written in the prepared format, so the ordinary loader and trainer read it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from ferry.data.manifest import DATASET_FORMAT, DATASET_VERSION, MANIFEST_NAME, file_entry

SYNTHETIC_KIND = "synthetic-zipf"


def synthetic_tokens(seed: int, vocab_size: int, count: int, exponent: float) -> np.ndarray:
    """`count` token ids in [0, vocab_size), P(id = r) proportional to 1 / (r + 1) ** exponent."""
    weights_V = 1.0 / np.arange(1, vocab_size + 1, dtype=np.float64) ** exponent
    cdf_V = np.cumsum(weights_V)
    cdf_V /= cdf_V[-1]
    raw = np.random.PCG64(seed).random_raw(count)
    uniform = (raw >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return np.minimum(np.searchsorted(cdf_V, uniform, side="right"), vocab_size - 1)


def write_synthetic_dataset(
    path: Path, seed: int, vocab_size: int, count: int, exponent: float, shard_tokens: int | None = None
) -> Path:
    """Write the tokens as a dataset with its manifest (no tokenizer: the ids are the data), in one shard or,
    with `shard_tokens`, in shards of that many tokens (the last one holds the rest): the same stream either
    way, so a set of many shards (a start-up benchmark's) reads as the one-shard set does."""
    path.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    tokens = synthetic_tokens(seed, vocab_size, count, exponent).astype(dtype)
    step = shard_tokens or max(count, 1)
    shards = []
    for index, start in enumerate(range(0, count, step)):
        shard = path / f"shard-{index:05d}.npy"
        np.save(shard, tokens[start : start + step])
        shards.append(file_entry(shard, tokens=min(step, count - start)))
    generator = {"seed": seed, "vocab_size": vocab_size, "tokens": count, "zipf_exponent": exponent}
    manifest = {
        "format": DATASET_FORMAT,
        "version": DATASET_VERSION,
        "tokenizer": {
            "kind": SYNTHETIC_KIND,
            "vocab_size": vocab_size,
            "eos_id": None,
            "file": None,
            "sha256": _digest(generator),
        },
        "dtype": np.dtype(dtype).name,
        "documents": 1,
        "total_tokens": count,
        "shards": shards,
        "settings": {"synthetic": generator},
    }
    (path / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    return path


def _digest(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
