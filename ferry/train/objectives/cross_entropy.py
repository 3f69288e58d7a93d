"""Token cross-entropy whose backward writes the gradient into the log-softmax it saved.

The logits of a step are its largest activation (tokens x vocabulary). `F.cross_entropy`'s backward
makes two more tensors of that size: the negative log-likelihood's gradient (zeros with one value a
row) and, from it, the logits' gradient. Here the forward is torch's own (log-softmax, then the
negative log-likelihood: the loss is bitwise torch's), and the backward turns the saved log-softmax
into the gradient where it lies:

    d loss_t / d logit_tv = g_t * (softmax_tv - [v == target_t]),  softmax = exp(log-softmax)

(g_t the incoming gradient of token t's loss, zero where the target is `ignore_index`): one pass for
the exponential and the scale, and a scatter of one value a row. No tensor of the logits' size is
allocated in the backward, so a step's peak holds one such tensor fewer, and the passes over it fall
from four to two (docs/performance.md measures the step). The gradient equals torch's up to the last
bit of the exponential (torch's log-softmax backward computes it with another implementation than
`Tensor.exp_`).

The saved log-softmax is overwritten, so the graph's backward runs once: a second backward through a
retained graph is refused by autograd's check on modified saved tensors. Under `torch.no_grad` nothing
is kept.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

Reduction = Literal["sum", "none"]


def cross_entropy(
    logits_TV: torch.Tensor, targets_T: torch.Tensor, ignore_index: int, reduction: Reduction
) -> torch.Tensor:
    """-log softmax(logits)[target] per token (`none`, 0 where ignored) or summed over the tokens (`sum`)."""
    return _CrossEntropy.apply(logits_TV, targets_T, ignore_index, reduction)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TV, targets_T, ignore_index, reduction):
        logp_TV = torch.log_softmax(logits_TV, dim=-1)
        ctx.save_for_backward(logp_TV, targets_T)
        ctx.ignore_index = ignore_index
        return F.nll_loss(logp_TV, targets_T, ignore_index=ignore_index, reduction=reduction)

    @staticmethod
    def backward(ctx, grad_loss):
        logp_TV, targets_T = ctx.saved_tensors
        trained_T = targets_T != ctx.ignore_index
        # the incoming gradient of each token's loss: a scalar for `sum`, one a token for `none`
        scale_T1 = (trained_T.to(logp_TV.dtype) * grad_loss).unsqueeze(1)
        grad_TV = logp_TV.exp_().mul_(scale_T1)
        target_T1 = targets_T.masked_fill(~trained_T, 0).unsqueeze(1)  # ignored rows add -0 at column 0
        grad_TV.scatter_add_(1, target_T1, scale_T1.neg())
        return grad_TV, None, None, None
