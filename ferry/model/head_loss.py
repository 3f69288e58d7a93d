"""The output projection and the token cross-entropy computed together, a chunk of tokens at a time.

The logits of a step (tokens x vocabulary) are the largest activation of a small MoE: 64 MiB in fp32
for 4,096 tokens of a 4,096-token vocabulary, 824 MiB for one OLMoE sequence of 4,096 tokens over
50,304, and the loss keeps them and their log-softmax (which its backward turns into their gradient in
place, `ferry/train/objectives/cross_entropy.py`). Here each chunk's logits are
made, reduced to the chunk's loss, and turned at once into the chunk's gradients for the hidden
states and the head's weight (softmax minus one-hot, two GEMMs), which backward only scales by the
loss's gradient. The GEMMs are those of logits-then-loss; what goes is the memory of the full logits
(two tensors of tokens x vocabulary), for one fp32 buffer of the head's weight size that holds its
gradient from forward to backward: a saving once a micro-batch has more tokens than half the model's
width (docs/performance.md measures both, and the time).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferry.data.targets import IGNORE_INDEX
from ferry.kernels.amp import in_autocast_dtype


@dataclass
class HeadTargets:
    """The next-token targets of a forward (IGNORE_INDEX where not trained) and the tokens per chunk."""

    targets_BS: torch.Tensor
    chunk_tokens: int


@dataclass
class HeadLoss:
    """The summed cross-entropy of the trained targets (differentiable), how many the model ranks first, and how
    many targets were trained."""

    lm_loss_sum: torch.Tensor
    correct: torch.Tensor
    trained: torch.Tensor | None = None


def chunked_head_loss(h_BSD: torch.Tensor, weight_VD: torch.Tensor, targets: HeadTargets) -> HeadLoss:
    """The loss of `h_BSD @ weight_VD.T` against the targets, without the full logits (see the module).

    Under autocast the GEMMs run in its dtype, as the head's `linear` would; the softmax is fp32.
    """
    h_TD, weight_VD = in_autocast_dtype(h_BSD.reshape(-1, h_BSD.shape[-1]), weight_VD)
    # a Function's forward sees grad mode off and its inputs' requires_grad whatever the caller's mode: ask here
    with_grad = torch.is_grad_enabled() and (h_TD.requires_grad or weight_VD.requires_grad)
    targets_T = targets.targets_BS.reshape(-1)
    lm_loss_sum, correct = _ChunkedHeadLoss.apply(h_TD, weight_VD, targets_T, targets.chunk_tokens, with_grad)
    return HeadLoss(lm_loss_sum, correct, (targets_T != IGNORE_INDEX).sum())


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TD, weight_VD, targets_T, chunk_tokens, with_grad):
        grad_h_TD = torch.empty_like(h_TD) if with_grad else None
        grad_weight_VD = torch.zeros_like(weight_VD, dtype=torch.float32) if with_grad else None
        loss_sum = torch.zeros((), dtype=torch.float32, device=h_TD.device)
        correct = torch.zeros((), dtype=torch.int64, device=h_TD.device)
        for start in range(0, h_TD.shape[0], chunk_tokens):
            h_CD = h_TD[start : start + chunk_tokens]
            targets_C = targets_T[start : start + chunk_tokens]
            logits_CV = (h_CD @ weight_VD.t()).float()
            trained_C = targets_C != IGNORE_INDEX
            safe_targets_C = torch.where(trained_C, targets_C, 0)
            log_partition_C = torch.logsumexp(logits_CV, dim=-1)
            target_logits_C = logits_CV.gather(1, safe_targets_C[:, None]).squeeze(1)
            loss_sum += torch.where(trained_C, log_partition_C - target_logits_C, 0.0).sum()
            correct += (logits_CV.argmax(dim=-1) == targets_C).sum()
            if not with_grad:
                continue
            grad_logits_CV = logits_CV.sub_(log_partition_C[:, None]).exp_()  # softmax, in place
            grad_logits_CV.scatter_add_(1, safe_targets_C[:, None], -trained_C[:, None].to(grad_logits_CV.dtype))
            grad_logits_CV.mul_(trained_C[:, None])
            grad_logits_CV = grad_logits_CV.to(h_CD.dtype)
            grad_h_TD[start : start + chunk_tokens] = grad_logits_CV @ weight_VD
            if h_CD.dtype == torch.float32:  # accumulated in place, without a weight-sized product
                grad_weight_VD.addmm_(grad_logits_CV.t(), h_CD)
            else:
                grad_weight_VD += (grad_logits_CV.t() @ h_CD).float()
        # held on the context, not saved for backward: once backward drops them, autograd can adopt the
        # buffers as the parameters' gradients instead of copying them
        ctx.grads = (grad_h_TD, grad_weight_VD)
        ctx.mark_non_differentiable(correct)
        ctx.weight_dtype = weight_VD.dtype
        return loss_sum, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        grad_h_TD, grad_weight_VD = ctx.grads  # scaled in place: no second weight-sized buffer
        del ctx.grads
        grad_h = grad_h_TD.mul_(grad_loss) if ctx.needs_input_grad[0] else None
        grad_weight = grad_weight_VD.mul_(grad_loss).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        del grad_h_TD, grad_weight_VD
        return grad_h, grad_weight, None, None, None
