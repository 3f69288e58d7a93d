"""Training runs for tests/test_pipeline_parallel.py: on spawned ranks or in this process, each reporting its losses,
metrics records and the balancing biases of the routers it holds (by MoE layer)."""

from __future__ import annotations

import json
from pathlib import Path

from distributed_training import tiny_config

from ferry.train import Trainer


def train_reporting(dataset: str, run_dir: str, *overrides: str) -> dict:
    trainer = Trainer(tiny_config(dataset, run_dir, *overrides))
    result = trainer.fit()
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    biases = {
        index: layer.router.expert_bias_E.tolist() for index, layer in trainer.model.moe_layers_by_index().items()
    }
    return {"losses": result.losses, "records": records, "biases": biases, "rank": trainer.parts.job.rank}
