"""The optimizer over a rank's parameters: AdamW, or Muon for the hidden matrices with AdamW for the rest."""

from __future__ import annotations

import torch
from torch import nn

from ferry.comm import Collectives
from ferry.parallel.adamw import fused_where_available
from ferry.parallel.muon import MuonSettings, MuonWithAdamW


def optimizer_over(
    params: list[tuple[str, nn.Parameter]],
    decayed: set[str],
    weight_decay: float,
    muon: MuonSettings | None,
    shard_owners: Collectives | None = None,
    **adamw,
):
    """torch's AdamW (its fused kernel wherever the device has one), decaying only the `decayed` names; with
    `muon`, Muon for the matrices it names (those FSDP shards orthogonalised by owners among `shard_owners`) and
    AdamW for the rest."""
    if muon is not None:
        return MuonWithAdamW(params, decayed, weight_decay, muon, shard_owners, **adamw)
    return torch.optim.AdamW(
        [
            {"params": [p for n, p in params if n in decayed], "weight_decay": weight_decay},
            {"params": [p for n, p in params if n not in decayed], "weight_decay": 0.0},
        ],
        **adamw,
        **fused_where_available([p for _, p in params]),
    )
