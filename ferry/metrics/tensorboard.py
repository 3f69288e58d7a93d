"""TensorBoard event files under `<run.dir>/tensorboard`, for people who already watch runs there.

Step, per-layer and per-source metrics become scalars under the names every tracker uses
(`ferry.metrics.names.scalars`).
"""

from __future__ import annotations

from pathlib import Path

from ferry.config.extras import import_extra
from ferry.metrics.names import TENSORBOARD_DIR, scalars


class TensorBoardSink:
    def __init__(self, run_dir: Path):
        tensorboard = import_extra(
            "torch.utils.tensorboard",
            "tensorboard",
            "metrics.sinks.tensorboard.enabled (or metrics.trackers: [tensorboard])",
            "TensorBoard",
        )
        self._writer = tensorboard.SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR))

    def write(self, record: dict) -> None:
        for tag, value in scalars(record).items():
            self._writer.add_scalar(tag, value, record["step"])

    def close(self) -> None:
        self._writer.close()
