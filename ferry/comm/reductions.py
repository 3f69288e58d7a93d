"""Scalars and small statistics reduced over the ranks of a job: the one place a step, an objective or the
resilience hook asks "what is the largest / the sum of this over every rank".

Sums of a step's statistics go through the collectives the parallel plan times (`sum_tensor`), so their bytes
count in the step's communication; the largest of a few values (an agreement: did any rank overflow, the longest
prompt, a restart count) is a control message and goes straight to the default group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ferry.comm.process_group import DistContext


def largest_over_world(values: list[float]) -> list[float]:
    """Each value's maximum over the default process group, on the device its backend works on (the values
    themselves in a single process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    backend = str(dist.get_backend())
    kind = {"nccl": "cuda", "xccl": "xpu"}.get(backend, "cpu")  # gloo, and mixed backends, take CPU tensors
    device = torch.device(kind, torch.get_device_module(kind).current_device()) if kind != "cpu" else None
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


class RankReductions:
    """Reductions over the job's ranks, the same results on every rank; in a single process each is the value
    itself. `sum_tensor` sums in place (the plan's timed all-reduce once the plan exists)."""

    def __init__(self, context: DistContext, device: torch.device, sum_tensor: Callable[[torch.Tensor], object]):
        self.context = context
        self.device = device
        self._sum_tensor = sum_tensor

    def largest(self, values: list[float]) -> list[float]:
        if not self.context.is_distributed:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()

    def sum(self, value: float) -> float:
        if not self.context.is_distributed:
            return value
        tensor = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        self._sum_tensor(tensor)
        return float(tensor.item())

    def sum_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        self._sum_tensor(tensor)
        return tensor
