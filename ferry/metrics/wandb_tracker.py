"""Weights & Biases as a tracker (`metrics.trackers: [wandb]`): the step records as W&B history, the resolved config
as the run's config, run.json's summary as its summary, run.json and the plots as an artifact of the run.

A resumed or restarted ferry run continues its W&B run (`resume: allow` with the id kept in the run directory). W&B
refuses a step below one it has logged, so the steps a restart trains again after its checkpoint keep their first
values there (metrics.jsonl keeps both). W&B's own console capture, system statistics and code saving are off: the
run's console is ferry's.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from ferry.metrics.config import WandbConfig
from ferry.config.extras import import_extra


class WandbTracker:
    name = "wandb"

    def __init__(self, config: WandbConfig, run_dir: Path, run_name: str):
        self._wandb = import_extra("wandb", "wandb", "metrics.trackers: wandb", "Weights & Biases")
        self.config = config
        self.run_dir = run_dir
        self.run_name = run_name
        self._run = None

    def open(self, run_id: str | None, config: dict, summary: dict) -> str:
        wandb = self._wandb
        server = {"base_url": self.config.base_url} if self.config.base_url else {}
        settings = wandb.Settings(
            init_timeout=self.config.init_timeout_s, console="off", save_code=False, x_disable_stats=True,
            silent=True, **server,
        )
        self._run = wandb.init(
            project=self.config.project, entity=self.config.entity, name=self.run_name,
            id=run_id or uuid.uuid4().hex[:12], resume="allow", mode=self.config.mode,
            dir=str(self.config.dir or self.run_dir), config=config, settings=settings,
        )
        self._run.summary.update(summary)
        return self._run.id

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def attach(self, paths: list[Path], summary: dict) -> None:
        """The files as one artifact of the run (`ferry-run`), at their places in the run directory."""
        artifact = self._wandb.Artifact(f"{self._run.id}-files", type="ferry-run")
        for path in paths:
            name = path.relative_to(self.run_dir) if path.is_relative_to(self.run_dir) else Path(path.name)
            artifact.add_file(str(path), name=name.as_posix())
        self._run.log_artifact(artifact)
        self._run.summary.update(summary)

    def close(self) -> None:
        self._run.finish()
