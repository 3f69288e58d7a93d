"""The largest attention logit of each head, over the training forwards of a step.

SDPA never forms the logits, so they are formed here a block of queries at a time, beside the attention, from the
same rotated queries and keys and under the same mask: an extra product of queries and keys per layer, paid only
when asked for (`metrics.attn_max_logit`, or `optim.muon.qk_clip`, which rescales the heads whose largest logit
passes its threshold). Forwards without gradients (scoring, evaluation, decoding) are not counted.
"""

from __future__ import annotations

import torch

QUERY_BLOCK = 256  # queries a product covers: [batch, heads, 256, keys] floats at a time


class MaxLogits:
    """Per head, the largest logit seen since the last `take`."""

    def __init__(self):
        self.max_H: torch.Tensor | None = None

    @torch.no_grad()
    def observe(
        self, q_BHSC: torch.Tensor, k_BGTC: torch.Tensor, scale: float, visible_BST: torch.Tensor | None
    ) -> None:
        """Queries of H heads against keys shared by groups of H / G heads; `visible_BST` the keys each query may
        see (None: causal, queries at the last S of T positions)."""
        heads, groups = q_BHSC.shape[1], k_BGTC.shape[1]
        k_BHTC = k_BGTC.float().repeat_interleave(heads // groups, dim=1)
        queries, keys = q_BHSC.shape[2], k_BHTC.shape[2]
        largest_H = torch.full((heads,), float("-inf"), device=q_BHSC.device)
        for start in range(0, queries, QUERY_BLOCK):
            stop = min(start + QUERY_BLOCK, queries)
            logits_BHsT = q_BHSC[:, :, start:stop].float() @ k_BHTC.mT * scale
            if visible_BST is None:
                positions_s = torch.arange(start, stop, device=q_BHSC.device) + keys - queries
                visible_sT = torch.arange(keys, device=q_BHSC.device)[None, :] <= positions_s[:, None]
                logits_BHsT = logits_BHsT.masked_fill(~visible_sT, float("-inf"))
            else:
                logits_BHsT = logits_BHsT.masked_fill(~visible_BST[:, None, start:stop], float("-inf"))
            largest_H = torch.maximum(largest_H, logits_BHsT.amax(dim=(0, 2, 3)))
        self.max_H = largest_H if self.max_H is None else torch.maximum(self.max_H, largest_H)

    def take(self) -> torch.Tensor | None:
        """The per-head maxima since the last take (None: no training forward since), cleared."""
        taken, self.max_H = self.max_H, None
        return taken
