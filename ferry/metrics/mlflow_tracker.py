"""MLflow as a tracker (`metrics.trackers: [mlflow]`): the step records as metrics, the resolved config as the
run's parameters (dotted keys), run.json's summary as tags, run.json and the plots as artifacts.

The store and the experiment are the config's, else MLflow's own environment variables (`MLFLOW_TRACKING_URI`,
`MLFLOW_EXPERIMENT_NAME`) when the user set them, else ferry's defaults: a database in the run directory
(`sqlite:///<run.dir>/mlflow.db`, its artifacts beside it; MLflow no longer takes a bare directory as its store) and
the experiment `ferry`. A resumed or restarted ferry run continues its MLflow run
(the id kept in the run directory); its parameters were logged at the start and are not logged again.
"""

from __future__ import annotations

import time
from pathlib import Path

from ferry.config.extras import import_extra
from ferry.metrics.config import MlflowConfig
from ferry.metrics.tracker_settings import TrackerSetting, resolve_setting
from ferry.metrics.tracker_sink import flattened

_BATCH = 100  # MLflow's limit on parameters a call (1,000 metrics; 100 parameters)
_TAG_CHARS = 5000


class MlflowTracker:
    name = "mlflow"
    loggers = ("mlflow", "alembic")  # its store's schema migrations log through alembic

    def __init__(self, config: MlflowConfig, run_dir: Path, run_name: str):
        tracking = import_extra("mlflow.tracking", "mlflow", "metrics.trackers: mlflow", "MLflow")
        entities = import_extra("mlflow.entities", "mlflow", "metrics.trackers: mlflow", "MLflow")
        self._entities = (entities.Metric, entities.Param, entities.RunTag)
        self._client_type = tracking.MlflowClient
        store = f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"
        self.settings: dict[str, TrackerSetting] = {
            "tracking_uri": resolve_setting(
                config.tracking_uri, "metrics.mlflow.tracking_uri", "MLFLOW_TRACKING_URI", store
            ),
            "experiment": resolve_setting(
                config.experiment, "metrics.mlflow.experiment", "MLFLOW_EXPERIMENT_NAME", "ferry"
            ),
        }
        self.active = True
        self.uri = self.settings["tracking_uri"].value
        self.experiment = self.settings["experiment"].value
        self.run_dir = run_dir
        self.run_name = run_name
        self._client = None
        self._run_id: str | None = None

    def open(self, run_id: str | None, config: dict, summary: dict) -> str:
        _, Param, _ = self._entities
        client = self._client = self._client_type(tracking_uri=self.uri)
        if run_id is not None:
            client.update_run(run_id, status="RUNNING")
            self._run_id = run_id
        else:
            found = client.get_experiment_by_name(self.experiment)
            experiment = (
                found.experiment_id
                if found is not None
                else client.create_experiment(self.experiment, artifact_location=self._artifacts())
            )
            self._run_id = client.create_run(experiment, run_name=self.run_name).info.run_id
            params = [Param(key, value) for key, value in flattened(config).items()]
            for start in range(0, len(params), _BATCH):
                client.log_batch(self._run_id, params=params[start : start + _BATCH])
        self._tag(summary)
        return self._run_id

    def log(self, step: int, values: dict[str, float]) -> None:
        Metric, _, _ = self._entities
        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in values.items()]
        self._client.log_batch(self._run_id, metrics=metrics)

    def attach(self, paths: list[Path], summary: dict) -> None:
        for path in paths:  # at the place they have in the run directory (plots/loss.png)
            folder = path.parent.relative_to(self.run_dir) if path.is_relative_to(self.run_dir) else Path()
            self._client.log_artifact(self._run_id, str(path), None if folder == Path() else folder.as_posix())
        self._tag(summary)

    def close(self) -> None:
        self._client.set_terminated(self._run_id)

    def _tag(self, summary: dict) -> None:
        _, _, RunTag = self._entities
        tags = [RunTag(key, str(value)[:_TAG_CHARS]) for key, value in summary.items()]
        for start in range(0, len(tags), _BATCH):
            self._client.log_batch(self._run_id, tags=tags[start : start + _BATCH])

    def _artifacts(self) -> str | None:
        """Beside a database in a file (MLflow would put them under the working directory); a server's own."""
        if self.uri.startswith("sqlite:///"):
            return str(Path(self.uri.removeprefix("sqlite:///")).parent / "mlflow-artifacts")
        return None
