"""Reading a prepared token dataset: manifest checks and memory-mapped windows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ferry.config.errors import UserError
from ferry.data.manifest import DATASET_FORMAT, DATASET_VERSION, MANIFEST_NAME, refuse_records
from ferry.data.verification import DataVerification, verify_files
from ferry.platform.digests import FAST


class TokenDataset:
    """The token stream of one prepared dataset, cut into windows of `seq_len + 1` tokens.

    Window i covers tokens [i * seq_len, (i + 1) * seq_len] inclusive, so consecutive
    windows share one token: the last target of one is the first input of the next.
    A dataset of packed conversations also holds a loss mask (1 where a token is
    trained) and can be read only with the row length it was packed for. Every file is checked
    against the manifest's `verify` digest before it is opened (`verified` says which).
    """

    def __init__(self, path: str | Path, label: str, verify: DataVerification = FAST):
        self.path = Path(path)
        self.label = label
        manifest_path = self.path / MANIFEST_NAME
        if not manifest_path.is_file():
            raise UserError(
                f"{label}: {str(self.path)!r} is not a prepared dataset (no {MANIFEST_NAME}); "
                "create it with `ferry data prepare`"
            )
        try:
            self.manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"{label}: {str(manifest_path)!r} is unreadable: {exc}") from None
        if self.manifest.get("format") != DATASET_FORMAT or self.manifest.get("version") != DATASET_VERSION:
            raise UserError(
                f"{label}: {str(manifest_path)!r} is not a {DATASET_FORMAT} v{DATASET_VERSION} manifest"
            )
        refuse_records(self.manifest, label, "a token-window reader (train.objective: lm, eval.loss)")
        self.verified = verify_files(self.path, self.manifest, label, verify)
        self.tokenizer = self.manifest["tokenizer"]
        self._shards = [self._open_shard(entry) for entry in self.manifest["shards"]]
        lengths = np.array([len(shard) for shard in self._shards], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(lengths)])
        self.num_tokens = int(self._starts[-1])
        mask = self.manifest.get("loss_mask")
        self._masks = [self._open_shard(entry) for entry in mask["shards"]] if mask else None
        if self._masks is not None and [len(m) for m in self._masks] != lengths.tolist():
            raise UserError(f"{label}: the loss mask shards of {str(self.path)!r} do not match its token shards")
        self.packed_seq_len: int | None = self.manifest["chat"]["seq_len"] if mask else None

    @property
    def has_loss_mask(self) -> bool:
        return self._masks is not None

    def check_seq_len(self, seq_len: int, setting: str) -> None:
        """Refuse reading packed rows with another length: windows would cut conversations apart."""
        if self.packed_seq_len is not None and seq_len != self.packed_seq_len:
            raise UserError(
                f"{self.label}: its conversations are packed into rows of {self.packed_seq_len} tokens, "
                f"{setting} is {seq_len}; set it to {self.packed_seq_len} or prepare the data with --seq-len {seq_len}"
            )

    def _open_shard(self, entry: dict) -> np.ndarray:
        path = self.path / entry["file"]
        try:
            shard = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise UserError(f"{self.label}: shard {str(path)!r} cannot be opened: {exc}") from None
        if shard.ndim != 1 or len(shard) != entry["tokens"]:
            raise UserError(
                f"{self.label}: shard {str(path)!r} holds {shard.shape} tokens, the manifest says {entry['tokens']}"
            )
        return shard

    def num_windows(self, seq_len: int) -> int:
        return max(0, (self.num_tokens - 1) // seq_len)

    def window(self, index: int, seq_len: int) -> np.ndarray:
        """Tokens [index * seq_len, index * seq_len + seq_len] as int64, read across shard borders."""
        return self._read(self._shards, index, seq_len).astype(np.int64)

    def window_mask(self, index: int, seq_len: int) -> np.ndarray:
        """Which tokens of `window(index, seq_len)` are trained (all of them without a loss mask)."""
        if self._masks is None:
            return np.ones(seq_len + 1, dtype=bool)
        return self._read(self._masks, index, seq_len).astype(bool)

    def _read(self, shards: list[np.ndarray], index: int, seq_len: int) -> np.ndarray:
        start = index * seq_len
        stop = start + seq_len + 1
        pieces = []
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        while start < stop:
            offset = start - int(self._starts[shard])
            take = min(stop - start, len(shards[shard]) - offset)
            pieces.append(shards[shard][offset : offset + take])
            start += take
            shard += 1
        return np.concatenate(pieces)
