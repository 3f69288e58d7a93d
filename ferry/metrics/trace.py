"""`profile.torch_trace: [first, last]`: a torch.profiler trace of those steps, for kernel-level questions
that the per-step metrics raise but cannot answer (which op, which stream, which wait)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ferry.metrics.config import ProfileConfig
from ferry.metrics.names import TRACE_DIR


class TorchTrace:
    """Call `step_started(step)` before and `step_finished(step)` after each step (1-based, as in records).

    Every rank writes its own chrome trace (`traces/rank<r>-steps-<first>-<last>.json`,
    readable in Perfetto or chrome://tracing): expert-parallel waits differ by rank.
    A run that stops inside the window writes what it recorded at `close()`.
    """

    def __init__(self, config: ProfileConfig, run_dir: Path, device: torch.device, rank: int = 0):
        self.window = config.torch_trace
        self.path = None
        if self.window is not None:
            self.path = run_dir / TRACE_DIR / f"rank{rank}-steps-{self.window[0]}-{self.window[1]}.json"
        accelerator = getattr(ProfilerActivity, device.type.upper(), None) if device.type != "cpu" else None
        self._activities = [ProfilerActivity.CPU] + ([accelerator] if accelerator is not None else [])
        self._profiler: profile | None = None

    def step_started(self, step: int) -> None:
        if self.window is not None and self._profiler is None and self.window[0] <= step <= self.window[1]:
            self._profiler = profile(activities=self._activities, record_shapes=True)
            self._profiler.start()

    def step_finished(self, step: int) -> None:
        if self._profiler is not None:
            self._profiler.step()
            if step >= self.window[1]:
                self.close()

    def close(self) -> None:
        """Stop and write the trace if one is being recorded."""
        if self._profiler is None:
            return
        self._profiler.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._profiler.export_chrome_trace(str(self.path))
        self._profiler = None
