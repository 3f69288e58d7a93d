"""Packing conversations into rows of exactly `seq_len` tokens, none split across rows.

Each conversation is followed by end-of-text and placed whole in the first of the open
rows it fits in (first fit over a window of `open_rows` rows, so short conversations fill
the gaps long ones leave); when more rows are open than that, the oldest is closed, its
rest filled with end-of-text padding. A conversation longer than a row is cut to the row
(counted, and reported by `ferry data prepare`); one left with no trained token by the cut
is dropped (counted too), so every row trains something. Padding and end-of-text are never
trained, and a row begins with `<|im_start|>` or padding, which are not trained either: so
when the loader reads window i as row i plus the first token of row i+1 (its usual
`seq_len + 1` tokens), that last target is masked, and with `data.document_masking` no
conversation sees another.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ferry.data.chat import RenderedConversation


@dataclass
class PackingStats:
    """What packing did, for the manifest: `conversations` placed, `truncated` of them cut to a row,
    `dropped` for having nothing trained left after the cut."""

    conversations: int = 0
    truncated: int = 0
    dropped: int = 0
    rows: int = 0
    trained_tokens: int = 0
    padding_tokens: int = 0

    def as_record(self) -> dict:
        return asdict(self)


class _Row:
    """A row being filled: its conversations' ids and trained flags, and how many tokens it holds."""

    def __init__(self) -> None:
        self.ids: list[np.ndarray] = []
        self.trained: list[np.ndarray] = []
        self.fill = 0


class RowPacker:
    """Collects conversations into rows of `seq_len` token ids with their trained flags."""

    def __init__(self, seq_len: int, eos_id: int, open_rows: int = 32):
        self.seq_len = seq_len
        self.eos_id = eos_id
        self.open_rows = open_rows
        self.stats = PackingStats()
        self._open: list[_Row] = []

    def add(self, conversation: RenderedConversation) -> tuple[np.ndarray, np.ndarray] | None:
        """Place one conversation; returns the row that placing it made the packer close, if any."""
        # the end-of-text after a conversation exactly a row long is what gives way
        ids = np.append(conversation.ids, self.eos_id)[: self.seq_len]
        trained = np.append(conversation.trained, False)[: self.seq_len]
        if len(conversation.ids) > self.seq_len:
            self.stats.truncated += 1
            if not trained.any():
                self.stats.dropped += 1
                return None
        row = next((row for row in self._open if row.fill + len(ids) <= self.seq_len), None)
        if row is None:
            row = _Row()
            self._open.append(row)
        row.ids.append(ids)
        row.trained.append(trained)
        row.fill += len(ids)
        self.stats.conversations += 1
        self.stats.trained_tokens += int(trained.sum())
        if len(self._open) > self.open_rows:
            return self._close(self._open.pop(0))
        return None

    def finish(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Close every open row, oldest first."""
        rows, self._open = self._open, []
        return [self._close(row) for row in rows]

    def _close(self, row: _Row) -> tuple[np.ndarray, np.ndarray]:
        padding = self.seq_len - row.fill
        ids = np.concatenate([*row.ids, np.full(padding, self.eos_id, dtype=np.int64)])
        trained = np.concatenate([*row.trained, np.zeros(padding, dtype=bool)])
        self.stats.rows += 1
        self.stats.padding_tokens += padding
        return ids, trained
