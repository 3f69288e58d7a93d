"""The timing, throughput, MFU and memory keys of a step record, computed the same way on every device."""

from __future__ import annotations

import resource
import sys

import torch

from ferry.metrics.timer import StepTimer, StepTimes


class StepMetrics:
    """Built once per run from what does not change between steps; `record()` once per step.

    `peak_flops` is one device's peak FLOP/s for the dtype the matmuls run in (the
    hardware profile's `peak_flops(policy.mfu_dtype)`), `flops_per_token` the model's
    training FLOPs per token (forward + backward), `world_size` the devices sharing a step.
    """

    def __init__(self, device: torch.device, world_size: int, flops_per_token: float, peak_flops: float):
        if world_size < 1 or flops_per_token <= 0 or peak_flops <= 0:
            raise ValueError(
                f"StepMetrics needs positive world_size, flops_per_token and peak_flops, got "
                f"{world_size}, {flops_per_token}, {peak_flops}"
            )
        self.device = device
        self.world_size = world_size
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.timer = StepTimer(device)

    def record(self, times: StepTimes, tokens: int) -> dict:
        """`tokens`: tokens the whole step trained on, over all devices.

        Compute is the phases' time not spent blocked in communication; MFU counts the
        model's FLOPs (not recomputation or padding) over all devices' peak.
        """
        busy_s = times.forward_s + times.backward_s + times.optimizer_s + times.generate_s
        compute_s = max(busy_s - times.blocked_s, 0.0)
        tokens_per_s = tokens / times.step_s
        return {
            "step_s": times.step_s,
            "forward_s": times.forward_s,
            "backward_s": times.backward_s,
            "optimizer_s": times.optimizer_s,
            "generate_s": times.generate_s,
            "compute_s": compute_s,
            "comm_s": times.comm_s,
            "comm_compute_ratio": times.comm_s / compute_s if compute_s > 0 else None,
            "ep_wait_s": times.ep_wait_s,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / self.world_size,
            "mfu": self.flops_per_token * tokens_per_s / (self.world_size * self.peak_flops),
            "mem_peak_mib": memory_peak_mib(self.device),
        }


def memory_peak_mib(device: torch.device) -> float:
    """High-water mark since the process started: allocated tensors on an accelerator, resident set on a CPU.

    The CPU figure includes the interpreter and libraries, as there is no separate
    tensor allocator to ask; both are never reset, so a step's figure is comparable
    with any earlier step's.
    """
    if device.type == "cpu":
        max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return max_rss / 2**20 if sys.platform == "darwin" else max_rss / 1024
    return torch.accelerator.max_memory_allocated(device) / 2**20
