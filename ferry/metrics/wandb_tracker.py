"""Weights & Biases as a tracker (`metrics.trackers: [wandb]`): the step records as W&B history, the resolved config
as the run's config, run.json's summary as its summary, run.json and the plots as an artifact of the run.

A resumed or restarted ferry run continues its W&B run (`resume: allow` with the id kept in the run directory). W&B
refuses a step below one it has logged, so the steps a restart trains again after its checkpoint keep their first
values there (metrics.jsonl keeps both). W&B's own console capture, system statistics and code saving are off: the
run's console is ferry's.

A setting the config leaves unset is left to W&B's environment variable when the user set it (W&B reads it itself),
else ferry's default is passed. `mode: disabled` (or `WANDB_MODE=disabled`) means what it means to W&B: no run, so
the tracker never starts and nothing counts as its failure.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from ferry.config.extras import import_extra
from ferry.metrics.config import WandbConfig
from ferry.metrics.tracker_settings import TrackerSetting, resolve_setting


class WandbTracker:
    name = "wandb"
    loggers = ("wandb",)

    def __init__(self, config: WandbConfig, run_dir: Path, run_name: str):
        self._wandb = import_extra("wandb", "wandb", "metrics.trackers: wandb", "Weights & Biases")
        self.config = config
        self.run_dir = run_dir
        self.run_name = run_name
        self._run = None
        found = {
            "project": resolve_setting(config.project, "metrics.wandb.project", "WANDB_PROJECT", "ferry"),
            "mode": resolve_setting(config.mode, "metrics.wandb.mode", "WANDB_MODE", "online"),
            "dir": resolve_setting(config.dir, "metrics.wandb.dir", "WANDB_DIR", str(run_dir)),
            "entity": resolve_setting(config.entity, "metrics.wandb.entity", "WANDB_ENTITY", None),
            "base_url": resolve_setting(config.base_url, "metrics.wandb.base_url", "WANDB_BASE_URL", None),
        }
        self.settings: dict[str, TrackerSetting] = {name: setting for name, setting in found.items() if setting}
        self.active = self.settings["mode"].value != "disabled"

    def open(self, run_id: str | None, config: dict, summary: dict) -> str:
        wandb = self._wandb
        passed = {name: setting.value for name, setting in self.settings.items() if not setting.from_environment}
        server = {"base_url": passed.pop("base_url")} if "base_url" in passed else {}
        settings = wandb.Settings(
            init_timeout=self.config.init_timeout_s,
            console="off",
            save_code=False,
            x_disable_stats=True,
            silent=True,
            **server,
        )
        # an offline run cannot be resumed (W&B says so on the console and starts a new one under the same id)
        offline = self.settings["mode"].value in ("offline", "dryrun")
        self._run = wandb.init(
            name=self.run_name,
            id=run_id or uuid.uuid4().hex[:12],
            resume=None if offline else "allow",
            config=config,
            settings=settings,
            **passed,
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
