"""Data-parallel gradient reduction for the expert-resident layout, and the global grad norm.

Dense parameters are replicated on every rank, so their gradients are summed over
all ranks; each expert lives on one rank of every EP group, so its gradient is
summed over the ranks holding the same experts (the mesh's `dp` dimension). The
loss is already normalised by the tokens of the whole global batch, hence SUM.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ferry.comm import Collectives


def reduce_gradients(
    params: list[nn.Parameter], collectives: Collectives | None, reduce_dtype: torch.dtype, bucket_bytes: int
) -> None:
    """Sum the gradients of `params` over `collectives`' group in flat buckets of `reduce_dtype`."""
    if collectives is None or collectives.size == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    for bucket in _buckets(grads, bucket_bytes):
        flat = _flatten_dense_tensors(bucket)
        reduced = collectives.all_reduce(flat.to(reduce_dtype)).to(flat.dtype)
        for grad, synced in zip(bucket, _unflatten_dense_tensors(reduced, bucket)):
            grad.copy_(synced)


def clip_grad_norm(
    dense: list[nn.Parameter],
    experts: list[nn.Parameter],
    ep: Collectives | None,
    max_norm: float,
    pp: Collectives | None = None,
) -> float:
    """Clip by the norm of the whole model's gradient, experts on other EP ranks and other pipeline stages'
    parameters included."""
    dense_sq = _sum_sq(dense)
    expert_sq = _sum_sq(experts)
    if ep is not None and ep.size > 1:
        expert_sq = ep.all_reduce(expert_sq)
    total_sq = dense_sq + expert_sq
    if pp is not None and pp.size > 1:
        total_sq = pp.all_reduce(total_sq)
    total = math.sqrt(total_sq.item())
    if max_norm > 0 and total > max_norm:
        scale = max_norm / (total + 1e-6)
        grads = [p.grad for p in dense + experts if p.grad is not None]
        torch._foreach_mul_(grads, scale)
    return total


def _sum_sq(params: list[nn.Parameter]) -> torch.Tensor:
    """The sum of squares of every gradient: each tensor's norm in fp32 (one read, no copy), summed in fp64.

    Casting every gradient to fp64 first cost a copy of the whole model's gradients per step, a tenth of
    a CPU step; a tensor's own fp32 norm is already accurate far below what clipping can notice.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
    return torch.stack(norms).double().pow(2).sum().cpu()


def _buckets(grads: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        if buckets[-1] and (size + nbytes > bucket_bytes or grad.dtype != buckets[-1][0].dtype):
            buckets.append([])
            size = 0
        buckets[-1].append(grad)
        size += nbytes
    return [bucket for bucket in buckets if bucket]
