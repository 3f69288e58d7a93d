"""A sequence split over the ranks of a context-parallel group: which positions this rank computes, and what its
attention needs of the others' (`parallel.cp`).

Causal attention makes the last positions of a sequence the most expensive (each sees every earlier key), so the
sequence is cut into 2N equal chunks and rank i keeps chunks i and 2N-1-i: every rank gets one cheap and one dear
chunk, the same work. A rank embeds, attends from, routes and scores only its own positions; the attention gathers
the keys and values of every rank's positions (`SequenceExchange.gather`, the parallel layer's collectives) and
hides, by position and document, those a query may not see, so RoPE positions and document masks hold right across
chunk borders. Sums over a sequence (a row's log-probability, the routers' means) are each rank's part, made whole
by `SequenceExchange.sum_parts` where a loss needs the whole.

Shapes: B rows, S positions of the whole (padded) sequence, L = S / N this rank's positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F


class SequenceExchange(Protocol):
    """The collectives of a context-parallel group (set by the parallel layer)."""

    def gather(self, x_BXLW: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `x` joined along `dim` in rank order, differentiably (the backward sums each rank's
        gradients of this rank's part and returns them here)."""

    def sum_parts(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`: on each rank the whole, its gradient flowing to this rank's part only
        (each rank's loss of the whole differentiates its own part; the gradients are summed over the ranks)."""

    def total(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, without gradient (counts)."""


@dataclass
class SequenceSplit:
    """Rank `rank` of `degree` ranks splitting every sequence, chunks i and 2N-1-i."""

    rank: int
    degree: int
    exchange: SequenceExchange
    _positions: dict = field(default_factory=dict, repr=False)

    @property
    def chunks(self) -> int:
        return 2 * self.degree

    def padded_length(self, seq_len: int) -> int:
        """The sequence length rounded up to whole chunks (the padding is marked, never trained, never seen)."""
        return -(-seq_len // self.chunks) * self.chunks

    def local(self, x_BS: torch.Tensor, fill: float | int | bool, padded: int | None = None) -> torch.Tensor:
        """This rank's positions of `x_BS` (any trailing dimensions), padded first with `fill` to whole chunks (or to
        `padded` positions, the length its inputs were padded to)."""
        seq_len = x_BS.shape[1]
        padded = padded or self.padded_length(seq_len)
        if padded != seq_len:
            trailing = [0, 0] * (x_BS.dim() - 2)
            x_BS = F.pad(x_BS, [*trailing, 0, padded - seq_len], value=fill)
        return x_BS.index_select(1, self.positions(padded // self.degree, x_BS.device))

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """The places in the whole sequence of this rank's `local_len` positions."""
        return self._positions_of(self.rank, local_len, device)

    def key_positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """The places in the whole sequence of the gathered keys, every rank's positions in rank order."""
        key = ("keys", local_len, device)
        if key not in self._positions:
            self._positions[key] = torch.cat(
                [self._positions_of(rank, local_len, device) for rank in range(self.degree)]
            )
        return self._positions[key]

    def own_masks(
        self,
        rows: int,
        seq_len: int,
        device: torch.device,
        document_ids_BS: torch.Tensor | None,
        padding_BS: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """This rank's part of the padding mask, and which gathered keys each of its positions sees, for inputs of
        `seq_len` positions. A sequence is padded to whole chunks: the padding is marked (the routers leave it out)
        and is its own document, after every real position."""
        padded = self.padded_length(seq_len)
        if padding_BS is None and padded != seq_len:
            padding_BS = torch.zeros((rows, seq_len), dtype=torch.bool, device=device)
        if document_ids_BS is not None and padded != seq_len:
            document_ids_BS = F.pad(document_ids_BS, (0, padded - seq_len), value=-1)
        visible_BLS = self.visibility(document_ids_BS, padded // self.degree, device)
        return (None if padding_BS is None else self.local(padding_BS, True)), visible_BLS

    def visibility(self, document_ids_BS: torch.Tensor | None, local_len: int, device: torch.device) -> torch.Tensor:
        """Which gathered keys each of this rank's queries sees: earlier (or the same) positions, of its own
        document when `document_ids_BS` (the whole padded sequence's) is given; [1 or B, L, S]."""
        queries_L = self.positions(local_len, device)
        keys_S = self.key_positions(local_len, device)
        visible_1LS = (keys_S[None, :] <= queries_L[:, None])[None]
        if document_ids_BS is None:
            return visible_1LS
        same_BLS = document_ids_BS[:, queries_L, None] == document_ids_BS[:, None, keys_S]
        return same_BLS & visible_1LS

    def _positions_of(self, rank: int, local_len: int, device: torch.device) -> torch.Tensor:
        key = (rank, local_len, device)
        if key not in self._positions:
            chunk = local_len // 2
            first, second = rank * chunk, (self.chunks - 1 - rank) * chunk
            self._positions[key] = torch.cat(
                [torch.arange(first, first + chunk, device=device), torch.arange(second, second + chunk, device=device)]
            )
        return self._positions[key]
