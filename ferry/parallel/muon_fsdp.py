"""Muon's orthogonalisation under FSDP: each matrix gathered whole to one owner, orthogonalised there once, and
each rank's rows of the result sent back.

FSDP shards every parameter by rows over the ranks, and Newton-Schulz must see a whole matrix. A stack of expert
matrices sharded by its first dimension gives each rank whole experts: those are orthogonalised where they are.
Every other matrix gets one owner (`ferry/parallel/ownership.py`: consecutive runs balanced by size): each rank
sends its rows of the update to the owner (a gather; every rank's rows padded to the first rank's count), all
owners orthogonalise at once, and each owner scatters the rows back. The compute is done once, spread over the
ranks, and each matrix crosses the network twice, as an all-gather and a reduce-scatter of it would.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

from ferry.comm import Collectives
from ferry.parallel.newton_schulz import orthogonalise
from ferry.parallel.ownership import owners_by_size


def orthogonalised_shards(
    updates: list[DTensor], steps: int, dtype: torch.dtype, owners: Collectives
) -> list[torch.Tensor]:
    """This rank's rows of each update's orthogonalisation, one local tensor per update (in `dtype`)."""
    results: list[torch.Tensor | None] = [None] * len(updates)
    spread = []
    for index, update in enumerate(updates):
        if update.placements != (Shard(0),):
            raise ValueError(f"Muon under FSDP expects parameters sharded by rows, not {update.placements}")
        if update.ndim >= 3:  # whole experts on every rank
            results[index] = orthogonalise(update.to_local(), steps, dtype)
        else:
            spread.append(index)
    rows_per_rank = {index: -(-updates[index].shape[0] // owners.size) for index in spread}
    assigned = owners_by_size([updates[index].numel() for index in spread], owners.size)
    wholes = {}
    for index, owner in zip(spread, assigned, strict=True):
        gathered = owners.gather(_padded(updates[index].to_local(), rows_per_rank[index]), owner, "muon_gather")
        if gathered is not None:
            wholes[index] = torch.cat(gathered)[: updates[index].shape[0]]
    for index, whole in wholes.items():
        wholes[index] = orthogonalise(whole, steps, dtype)
    for index, owner in zip(spread, assigned, strict=True):
        local = updates[index].to_local()
        rows = rows_per_rank[index]
        pieces = list(_padded(wholes[index], rows * owners.size).split(rows)) if index in wholes else None
        received = owners.scatter(local.new_empty((rows, *local.shape[1:]), dtype=dtype), pieces, owner, "muon_scatter")
        results[index] = received[: local.shape[0]]
    return results


def _padded(rows_RX: torch.Tensor, rows: int) -> torch.Tensor:
    """`rows_RX` with zero rows appended up to `rows` (gather and scatter move pieces of one shape)."""
    if rows_RX.shape[0] == rows:
        return rows_RX.contiguous()
    padded = rows_RX.new_zeros((rows, *rows_RX.shape[1:]))
    padded[: rows_RX.shape[0]] = rows_RX
    return padded
