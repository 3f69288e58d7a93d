"""Data: tokenizers, token shards, the embedded corpus, and the deterministic mixed loader.

Preparing data needs no torch: the loader's names (which build tensors) are imported on first use, so that a
preparation's processes, every worker among them, do not pay torch's import (about a second each).
"""

from importlib import import_module

from ferry.data.config import DataConfig, SourceConfig
from ferry.data.cursor import DataCursor
from ferry.data.dataset import TokenDataset
from ferry.data.prepare import PrepareSpec, prepare_dataset

_ON_FIRST_USE = {
    "document_ids": "ferry.data.documents",
    "Batch": "ferry.data.loader",
    "MixedLoader": "ferry.data.loader",
}

__all__ = [
    "DataConfig",
    "SourceConfig",
    "TokenDataset",
    "document_ids",
    "Batch",
    "DataCursor",
    "MixedLoader",
    "PrepareSpec",
    "prepare_dataset",
]


def __getattr__(name: str):
    if name in _ON_FIRST_USE:
        return getattr(import_module(_ON_FIRST_USE[name]), name)
    raise AttributeError(f"module 'ferry.data' has no attribute {name!r}")
