"""Each step's largest attention logits and, with `optim.muon.qk_clip`, QK-clip (Kimi K2's MuonClip).

Muon's updates can let query-key products grow until the softmax saturates; K2 bounds them by scaling, after each
update, the query and key weights of every head whose largest logit in that update's forwards passed the threshold
tau, by gamma = tau / max logit (each attention kind knows which of its weights carry a head's logits:
`clip_logits`). The maxima are agreed over all ranks first (the largest of every rank's, each rank its own layers
under a pipeline), so replicas of a weight scale it alike and stay equal.
"""

from __future__ import annotations

import torch

from ferry.comm.reductions import RankReductions
from ferry.model import Transformer


class AttentionLogits:
    """The trackers of `model`'s attention layers (those it holds), reduced over the ranks by `reductions`; with
    `tau`, the clip."""

    def __init__(self, model: Transformer, reductions: RankReductions, tau: float | None):
        self.layers = {index: model.layers[index].attn for index in model.held_blocks()}
        self.n_layers, self.n_heads = model.config.n_layers, model.config.n_heads
        self.reductions = reductions
        self.tau = tau
        self._figures: dict = {}

    def after_update(self, stepped: bool) -> None:
        """Take the maxima of the update's forwards; where the optimizer stepped, clip the heads past tau."""
        max_LH = torch.full((self.n_layers, self.n_heads), float("-inf"))
        for index, attention in self.layers.items():
            taken = attention.max_logits.take()
            if taken is not None:
                max_LH[index] = taken.float().cpu()
        max_LH = torch.tensor(self.reductions.largest(max_LH.flatten().tolist())).view(self.n_layers, self.n_heads)
        clipped = 0
        if self.tau is not None and stepped:
            past_LH = max_LH > self.tau
            gamma_LH = torch.where(past_LH, self.tau / max_LH, 1.0)
            for index, attention in self.layers.items():
                if bool(past_LH[index].any()):
                    attention.clip_logits(gamma_LH[index].to(attention.wo.weight.device))
            clipped = int(past_LH.sum())
        self._figures = {"attn.max_logit": float(max_LH.max()), "attn.clipped_heads": clipped}

    def figures(self) -> dict:
        """The step's record: its largest logit over every layer and head, and the heads clipped after it."""
        return self._figures
