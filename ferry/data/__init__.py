"""Data: tokenizers, token shards, the embedded corpus, and the deterministic mixed loader."""

from ferry.data.config import DataConfig, SourceConfig
from ferry.data.dataset import TokenDataset
from ferry.data.documents import document_ids
from ferry.data.loader import Batch, DataCursor, MixedLoader
from ferry.data.prepare import PrepareSpec, prepare_dataset

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
