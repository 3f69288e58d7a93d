"""Reading a prepared token dataset: manifest checks and windows read across its shards."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ferry.config.errors import UserError
from ferry.data.manifest import DATASET_FORMAT, DATASET_VERSION, MANIFEST_NAME, refuse_records
from ferry.data.verification import (
    DatasetMismatch,
    DataVerification,
    digests_checked,
    verify_entry,
    verify_files,
)
from ferry.platform.digests import FAST


class TokenDataset:
    """The token stream of one prepared dataset, cut into windows of `seq_len + 1` tokens.

    Window i covers tokens [i * seq_len, (i + 1) * seq_len] inclusive, so consecutive
    windows share one token: the last target of one is the first input of the next.
    A dataset of packed conversations also holds a loss mask (1 where a token is
    trained) and can be read only with the row length it was packed for.

    Every file is checked against the manifest's `verify` digest before any of its tokens is read
    (`verified` says which digest): all of them here, `upfront`, or, for a set too large to read
    whole at every start, the tokenizer here and each shard when it is first read
    (`verified_at`). Nothing is held open between reads: a window's pieces are read with one
    `open` and `read` each (a few microseconds), so a set of 100,000 shards needs no more file
    handles than a set of one, and opening it reads only its manifest.
    """

    def __init__(self, path: str | Path, label: str, verify: DataVerification = FAST, upfront: bool = True):
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
            raise UserError(f"{label}: {str(manifest_path)!r} is not a {DATASET_FORMAT} v{DATASET_VERSION} manifest")
        refuse_records(self.manifest, label, "a token-window reader (train.objective: lm, eval.loss)")
        self.tokenizer = self.manifest["tokenizer"]
        self._verify = verify
        if verify != "none" and self.tokenizer.get("file") and not upfront:
            verify_entry(self.path, self.tokenizer, label, verify)  # small, and read by everything: checked now
        self.verified = digests_checked(self.manifest, verify)
        self.verified_at = "first read" if verify != "none" else None
        lazy = None if verify == "none" else verify
        self._tokens = _Shards(self.path, self.manifest["shards"], label, lazy)
        self.num_tokens = self._tokens.total
        mask = self.manifest.get("loss_mask")
        self._masks = _Shards(self.path, mask["shards"], label, lazy) if mask else None
        if self._masks is not None and self._masks.lengths != self._tokens.lengths:
            raise UserError(f"{label}: the loss mask shards of {str(self.path)!r} do not match its token shards")
        self.packed_seq_len: int | None = self.manifest["chat"]["seq_len"] if mask else None
        if upfront:
            self.check_all()

    def check_all(self) -> None:
        """Check every file now, and open every shard: what is wrong with the set is refused before anything
        else happens (a run's directory is not touched yet)."""
        verify_files(self.path, self.manifest, self.label, self._verify)
        self.verified_at = "start" if self._verify != "none" else None
        for shards in (self._tokens, self._masks):
            if shards is not None:
                shards.lazy = None
                shards.open_all()

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

    def num_windows(self, seq_len: int) -> int:
        return max(0, (self.num_tokens - 1) // seq_len)

    def window(self, index: int, seq_len: int) -> np.ndarray:
        """Tokens [index * seq_len, index * seq_len + seq_len] as int64, read across shard borders."""
        return self._tokens.read(index * seq_len, seq_len + 1).astype(np.int64)

    def window_mask(self, index: int, seq_len: int) -> np.ndarray:
        """Which tokens of `window(index, seq_len)` are trained (all of them without a loss mask)."""
        if self._masks is None:
            return np.ones(seq_len + 1, dtype=bool)
        return self._masks.read(index * seq_len, seq_len + 1).astype(bool)


class _Shards:
    """The `.npy` files of one stream (tokens or loss mask) in manifest order, their lengths as the manifest
    records them. A shard is opened (checked against `lazy`, a digest, when given, then its header read) the
    first time it is read; what its header said, where its data starts and its dtype, is kept."""

    def __init__(self, directory: Path, entries: list[dict], label: str, lazy: str | None):
        self.directory = directory
        self.entries = entries
        self.label = label
        self.lazy = lazy
        self.lengths = [int(entry["tokens"]) for entry in entries]
        self.starts = np.concatenate([[0], np.cumsum(np.array(self.lengths, dtype=np.int64))])
        self.total = int(self.starts[-1])
        self._layout: dict[int, tuple[int, np.dtype]] = {}

    def open_all(self) -> None:
        for shard in range(len(self.entries)):
            self._open(shard)

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) of the stream."""
        stop = start + count
        pieces = []
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            offset = start - int(self.starts[shard])
            take = min(stop - start, self.lengths[shard] - offset)
            pieces.append(self._read_piece(shard, offset, take))
            start += take
            shard += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _read_piece(self, shard: int, offset: int, count: int) -> np.ndarray:
        data_offset, dtype = self._layout.get(shard) or self._open(shard)
        path = self.directory / self.entries[shard]["file"]
        wanted = count * dtype.itemsize
        try:
            with open(path, "rb", buffering=0) as handle:
                handle.seek(data_offset + offset * dtype.itemsize)
                data = handle.read(wanted)
        except OSError as exc:
            raise DatasetMismatch(f"{self.label}: shard {str(path)!r} cannot be read: {exc}", path) from None
        if len(data) != wanted:
            raise DatasetMismatch(f"{self.label}: shard {str(path)!r} was cut short while the run read it", path)
        return np.frombuffer(data, dtype=dtype)

    def _open(self, shard: int) -> tuple[int, np.dtype]:
        entry = self.entries[shard]
        path = self.directory / entry["file"]
        if self.lazy is not None:
            verify_entry(self.directory, entry, self.label, self.lazy)
        try:
            with open(path, "rb") as handle:
                if np.lib.format.read_magic(handle) == (1, 0):
                    shape, _, dtype = np.lib.format.read_array_header_1_0(handle)
                else:
                    shape, _, dtype = np.lib.format.read_array_header_2_0(handle)
                data_offset = handle.tell()
        except (OSError, ValueError) as exc:
            raise UserError(f"{self.label}: shard {str(path)!r} cannot be opened: {exc}") from None
        if len(shape) != 1 or shape[0] != entry["tokens"] or dtype.hasobject:
            raise UserError(
                f"{self.label}: shard {str(path)!r} holds {shape} tokens, the manifest says {entry['tokens']}"
            )
        self._layout[shard] = (data_offset, dtype)
        return self._layout[shard]
