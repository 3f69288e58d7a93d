"""The timing, throughput, MFU and memory keys of a step record, computed the same way on every device."""

from __future__ import annotations

import resource
import sys

import torch

from ferry.metrics.timer import StepTimer, StepTimes
from ferry.platform.hardware import MfuPeak


class StepMetrics:
    """Built once per run from what does not change between steps; `record()` once per step.

    `peak_flops` is one device's peak FLOP/s for the dtype the matmuls run in (the
    hardware profile's, with its source: `MfuPeak.of_profile`; or a plain number), `flops_per_token` the model's
    training FLOPs per token (forward + backward), `world_size` the devices sharing a step.

    An MFU above 100% means the peak is wrong, not that the run beat the hardware: a measured CPU peak is measured
    again then (once), and a warning naming the peak and its source waits in `notes` for the run to print.
    """

    def __init__(self, device: torch.device, world_size: int, flops_per_token: float, peak_flops: float | MfuPeak):
        peak = peak_flops if isinstance(peak_flops, MfuPeak) else MfuPeak.fixed(peak_flops)
        if world_size < 1 or flops_per_token <= 0 or peak.flops <= 0:
            raise ValueError(
                f"StepMetrics needs positive world_size, flops_per_token and peak_flops, got "
                f"{world_size}, {flops_per_token}, {peak.flops}"
            )
        self.device = device
        self.world_size = world_size
        self.flops_per_token = flops_per_token
        self.peak = peak
        self.timer = StepTimer(device)
        self.notes: list[str] = []
        self._peak_doubted = False

    @property
    def peak_flops(self) -> float:
        return self.peak.flops

    def take_notes(self) -> list[str]:
        """The warnings gathered since the last call, for the run to print."""
        notes, self.notes = self.notes, []
        return notes

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
            "mfu": self._mfu(tokens_per_s),
            "mem_peak_mib": memory_peak_mib(self.device),
        }

    def _mfu(self, tokens_per_s: float) -> float:
        """Model FLOPs over the devices' peak; the first time it exceeds 1, the peak is doubted: measured again where
        it was measured, and if it still exceeds 1, a warning names the peak it was computed against."""
        mfu = self.flops_per_token * tokens_per_s / (self.world_size * self.peak.flops)
        if mfu <= 1.0 or self._peak_doubted:
            return mfu
        self._peak_doubted = True
        stale = self.peak.describe()
        if self.peak.measurable:
            self.peak.remeasure()
            remeasured = self.flops_per_token * tokens_per_s / (self.world_size * self.peak.flops)
            if remeasured <= 1.0:
                self.notes.append(
                    f"ferry: warning: MFU {mfu:.1%} was computed against {stale}, which this run outpaced: measured "
                    f"again, {self.peak.describe()}; MFU {remeasured:.1%} from here on"
                )
                return remeasured
            mfu = remeasured
            stale = self.peak.describe()
        self.notes.append(
            f"ferry: warning: MFU {mfu:.1%} is above 100%: {stale} is below what this run computes; measure the peak "
            "again on an idle machine (`ferry hardware measure`) or correct the profile; MFU figures of this run are "
            "too high"
        )
        return mfu


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
