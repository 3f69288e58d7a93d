"""Where each tracker setting comes from: the run's config when it gives one, else the tracker library's own
environment variable (`WANDB_MODE`, `MLFLOW_TRACKING_URI`, ...) when the user has set it, else ferry's default.

A team that already sets W&B's or MLflow's variables for every job expects them to hold; ferry's config wins only
where it says something. The console and run.json name each setting's source, so a run that went to the wrong
project or store says why.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class TrackerSetting:
    """A setting's value and its source: the config key, the environment variable, or `default` (ferry's)."""

    value: str
    source: str
    from_environment: bool = False

    def as_record(self) -> dict:
        return {"value": self.value, "from": self.source}


def resolve_setting(configured: str | None, key: str, variable: str, default: str | None) -> TrackerSetting | None:
    """The config's `key` when it is set, else `variable` when the environment sets it (non-empty), else `default`
    (None: the setting is left to the library)."""
    if configured is not None:
        return TrackerSetting(configured, key)
    given = os.environ.get(variable)
    if given:
        return TrackerSetting(given, variable, from_environment=True)
    return None if default is None else TrackerSetting(default, "default")


def describe_settings(settings: dict[str, TrackerSetting]) -> str:
    """`project ferry (default), mode offline (WANDB_MODE)`: each setting with its source, for the console."""
    return ", ".join(f"{name} {setting.value} ({setting.source})" for name, setting in settings.items())
