"""Multi-token prediction (DeepSeek-V3): sequential modules that each predict one token further ahead.

Module k (1-based) reads, at position i, the previous module's hidden state (the model's own, final-normed, for
k = 1) and the embedding of token i + k, each RMS-normalised, concatenated (embedding first) and projected back to
the model's width; one block (attention and feed-forward, MoE where the model's last block is) and a norm follow,
and the model's own head gives the logits of token i + k + 1. The embedding and the head are the model's, shared.
In training each module's loss is the cross-entropy of those targets (a position whose token i + k is past the
row, or in another document, trains nothing), added to the objective with `mtp.loss_weight / depth`. The densified
signal is the reason (DeepSeek-V3 trained with one module); at inference the modules can draft tokens, and the
main head alone is the model.

The names follow DeepSeek's checkpoints (`enorm`, `hnorm`, `eh_proj`, the block, `shared_head.norm`), which
`ferry/interop/deepseek.py` writes at layer indices `n_layers` onward.
"""

from __future__ import annotations

import torch
from torch import nn

from ferry.data.targets import IGNORE_INDEX
from ferry.kernels import KernelSelection
from ferry.model.linear import Linear
from ferry.model.norm import RMSNorm


class MTPModule(nn.Module):
    """One depth: the two norms, the projection, a block and the output norm."""

    def __init__(self, config, block: nn.Module, kernels: KernelSelection):
        super().__init__()
        self.embed_norm = RMSNorm(config.dim, config.norm_eps, kernels)
        self.hidden_norm = RMSNorm(config.dim, config.norm_eps, kernels)
        self.proj = Linear(2 * config.dim, config.dim, kernels)
        self.block = block
        self.norm = RMSNorm(config.dim, config.norm_eps, kernels)

    def forward(
        self,
        ahead_BSD: torch.Tensor,
        h_BSD: torch.Tensor,
        visible_BSS: torch.Tensor | None,
        padding_BS: torch.Tensor | None,
    ):
        """This depth's final-normed hidden states from the embeddings of the tokens ahead and the previous depth's
        hidden states; and its block's MoE statistics (None for a dense block)."""
        x_BSD = self.proj(torch.cat([self.embed_norm(ahead_BSD), self.hidden_norm(h_BSD)], dim=-1))
        y_BSD, stats = self.block(x_BSD, None, visible_BSS, padding_BS)
        return self.norm(y_BSD), stats


def ahead(x_BS: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """`x_BS` moved `k` positions to the left (position i holds i + k), the last `k` filled with `fill`."""
    filler_BK = x_BS.new_full((x_BS.shape[0], k), fill)
    return torch.cat([x_BS[:, k:], filler_BK], dim=1)[:, : x_BS.shape[1]]


def targets_ahead(targets_BS: torch.Tensor, k: int, document_ids_BS: torch.Tensor | None) -> torch.Tensor:
    """Module k's targets: the next-token targets `k` positions on, none where that crosses the row's end or, with
    document masking, its document's."""
    moved_BS = ahead(targets_BS, k, IGNORE_INDEX)
    if document_ids_BS is not None:
        crossing_BS = ahead(document_ids_BS, k, -1) != document_ids_BS
        moved_BS = moved_BS.masked_fill(crossing_BS, IGNORE_INDEX)
    return moved_BS
