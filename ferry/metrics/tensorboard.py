"""TensorBoard event files under `<run.dir>/tensorboard`, for people who already watch runs there.

Step, per-layer and per-source metrics become scalars (tag = record key, `/layer<i>` for a
layer, `/<source>` for a held-out source); per-expert loads stay in metrics.jsonl and Prometheus, where a heatmap can
show them, instead of thousands of scalar charts.
"""

from __future__ import annotations

from pathlib import Path

from ferry.config import UserError
from ferry.metrics.names import METRICS, TENSORBOARD_DIR


class TensorBoardSink:
    def __init__(self, run_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError(
                "metrics.sinks.tensorboard.enabled is true but the tensorboard package is not installed; "
                "install it with: pip install 'ferry-moe[tensorboard]'"
            ) from None
        self._writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR))

    def write(self, record: dict) -> None:
        step = record["step"]
        for metric in METRICS:
            value = record.get(metric.key)
            if value is None or metric.shape == "expert":
                continue
            if metric.shape == "step":
                self._writer.add_scalar(metric.key, value, step)
            elif metric.shape == "source":
                for source, source_value in value.items():
                    self._writer.add_scalar(f"{metric.key}/{source}", source_value, step)
            else:  # per layer or per stage
                for index, indexed_value in enumerate(value):
                    self._writer.add_scalar(f"{metric.key}/{metric.shape}{index}", indexed_value, step)

    def close(self) -> None:
        self._writer.close()
