"""The trackers' own environment variables hold where the config says nothing, and the config wins where it does:
W&B offline (read back with its record reader, as tests/test_trackers.py does) and MLflow on SQLite, each with its
variables set and unset. `WANDB_MODE=disabled` means no run and no failure. The console and run.json name each
setting's source, and MLflow's INFO lines go to the run's libraries.log, not between the step lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2
from wandb.sdk.internal.datastore import DataStore

from ferry.metrics.jsonl import read_metrics
from ferry.train import Trainer


@pytest.fixture(autouse=True)
def _clean_tracker_environment(monkeypatch):
    """No variable of the machine running the suite leaks in; W&B's crash reporter stays off. W&B reads its
    variables once a process, at its first run, so its process-wide state is torn down around each test: a
    ferry run is a process of its own, which reads them afresh."""
    import wandb

    for name in (
        "WANDB_MODE",
        "WANDB_PROJECT",
        "WANDB_DIR",
        "WANDB_ENTITY",
        "WANDB_BASE_URL",
        "MLFLOW_TRACKING_URI",
        "MLFLOW_EXPERIMENT_NAME",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    wandb.teardown()
    yield
    wandb.teardown()


def _wandb_project(wandb_dir: Path) -> str:
    """The project an offline W&B run under `wandb_dir` was opened in, from its run record."""
    [path] = wandb_dir.glob("wandb/offline-run-*/run-*.wandb")
    store = DataStore()
    store.open_for_scan(str(path))
    while (data := store.scan_data()) is not None:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "run":
            return record.run.project
    raise AssertionError(f"{path} holds no run record")


def _settings(run_dir: Path, tracker: str) -> dict:
    return json.loads((run_dir / "run.json").read_text())["trackers"][tracker]


def test_wandb_takes_its_mode_project_and_dir_from_the_environment_when_the_config_is_silent(
    make_config, tmp_path, monkeypatch, capsys
):
    wandb_dir = tmp_path / "wandb-files"
    wandb_dir.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "from-the-environment")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    run_dir = tmp_path / "run"
    Trainer(make_config("metrics.trackers=[wandb]", "train.steps=2", run_dir=run_dir)).fit()
    assert _wandb_project(wandb_dir) == "from-the-environment"
    assert not (run_dir / "wandb").exists(), "W&B wrote where WANDB_DIR says, not in the run directory"
    outcome = _settings(run_dir, "wandb")
    assert outcome["failures"] == 0 and outcome["active"]
    assert outcome["settings"] == {
        "project": {"value": "from-the-environment", "from": "WANDB_PROJECT"},
        "mode": {"value": "offline", "from": "WANDB_MODE"},
        "dir": {"value": str(wandb_dir), "from": "WANDB_DIR"},
    }
    said = capsys.readouterr()
    assert (
        f"ferry: tracker wandb: project from-the-environment (WANDB_PROJECT), mode offline (WANDB_MODE), "
        f"dir {wandb_dir} (WANDB_DIR)"
    ) in said.out + said.err


def test_the_config_wins_over_wandbs_variables_and_ferrys_defaults_fill_the_rest(make_config, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")  # the config's offline must win, or this run would try W&B's servers
    monkeypatch.setenv("WANDB_PROJECT", "from-the-environment")
    run_dir = tmp_path / "run"
    Trainer(
        make_config(
            "metrics.trackers=[wandb]",
            "metrics.wandb.mode=offline",
            "metrics.wandb.project=configured",
            "train.steps=2",
            run_dir=run_dir,
        )
    ).fit()
    assert _wandb_project(run_dir) == "configured"
    assert _settings(run_dir, "wandb")["settings"] == {
        "project": {"value": "configured", "from": "metrics.wandb.project"},
        "mode": {"value": "offline", "from": "metrics.wandb.mode"},
        "dir": {"value": str(run_dir), "from": "default"},
    }


def test_wandb_mode_disabled_opens_no_run_and_counts_no_failure(make_config, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    run_dir = tmp_path / "run"
    result = Trainer(make_config("metrics.trackers=[wandb]", "train.steps=3", run_dir=run_dir)).fit()
    assert len(result.losses) == 3
    assert not (run_dir / "wandb").exists() and not (run_dir / "trackers.json").exists()
    assert all(record["tracker_failures"] == 0 for record in read_metrics(run_dir))
    outcome = _settings(run_dir, "wandb")
    assert (outcome["run_id"], outcome["failures"], outcome["active"]) == (None, 0, False)
    assert outcome["settings"]["mode"] == {"value": "disabled", "from": "WANDB_MODE"}
    said = capsys.readouterr()
    assert (
        "ferry: tracker wandb: disabled by its mode, no run; project ferry (default), mode disabled (WANDB_MODE)"
        in said.out + said.err
    )
    assert "warning: tracker" not in said.out + said.err


def test_mlflow_takes_its_store_and_experiment_from_the_environment_and_keeps_its_info_lines_off_the_console(
    make_config, tmp_path, monkeypatch, capsys
):
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-the-environment")
    run_dir = tmp_path / "run"
    Trainer(make_config("metrics.trackers=[mlflow]", "train.steps=2", run_dir=run_dir)).fit()
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=store)
    assert client.get_experiment(client.get_run(run_id).info.experiment_id).name == "from-the-environment"
    assert not (run_dir / "mlflow.db").exists()
    assert _settings(run_dir, "mlflow")["settings"] == {
        "tracking_uri": {"value": store, "from": "MLFLOW_TRACKING_URI"},
        "experiment": {"value": "from-the-environment", "from": "MLFLOW_EXPERIMENT_NAME"},
    }
    said = capsys.readouterr()
    console = said.out + said.err
    assert f"ferry: tracker mlflow: tracking_uri {store} (MLFLOW_TRACKING_URI)" in console
    assert "INFO mlflow" not in console and "Creating initial MLflow database tables" not in console
    assert "Creating initial MLflow database tables" in (run_dir / "libraries.log").read_text()


def test_mlflows_config_wins_over_its_variables(make_config, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'not-this.db'}")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "not-this")
    run_dir = tmp_path / "run"
    store = f"sqlite:///{tmp_path / 'configured.db'}"
    Trainer(
        make_config(
            "metrics.trackers=[mlflow]",
            f"metrics.mlflow.tracking_uri={store}",
            "metrics.mlflow.experiment=configured",
            "train.steps=2",
            run_dir=run_dir,
        )
    ).fit()
    assert not (tmp_path / "not-this.db").exists()
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=store)
    assert client.get_experiment(client.get_run(run_id).info.experiment_id).name == "configured"
    assert _settings(run_dir, "mlflow")["settings"] == {
        "tracking_uri": {"value": store, "from": "metrics.mlflow.tracking_uri"},
        "experiment": {"value": "configured", "from": "metrics.mlflow.experiment"},
    }


def test_mlflow_falls_back_to_ferrys_store_in_the_run_directory_with_its_variables_unset(make_config, tmp_path):
    run_dir = tmp_path / "run"
    Trainer(make_config("metrics.trackers=[mlflow]", "train.steps=2", run_dir=run_dir)).fit()
    assert (run_dir / "mlflow.db").is_file()
    assert _settings(run_dir, "mlflow")["settings"] == {
        "tracking_uri": {"value": f"sqlite:///{run_dir.resolve() / 'mlflow.db'}", "from": "default"},
        "experiment": {"value": "ferry", "from": "default"},
    }


def test_the_wandb_read_back_code_docs_trackers_shows_reads_every_step_it_prints(make_config, tmp_path, capsys):
    """The Python block of docs/trackers.md that reads an offline W&B run, run on a run of this test: the names
    with a slash read through `nested_key` (a read of `key` alone gets None)."""
    import re

    page = (Path(__file__).resolve().parent.parent / "docs" / "trackers.md").read_text()
    [code] = [block for block in re.findall(r"```python\n(.*?)```", page, re.S) if "DataStore" in block]
    run_dir = tmp_path / "trk"
    Trainer(
        make_config("metrics.trackers=[wandb]", "metrics.wandb.mode=offline", "train.steps=20", run_dir=run_dir)
    ).fit()
    capsys.readouterr()
    exec(compile(code.replace("/tmp/trk", str(run_dir)), "docs/trackers.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    records = {record["step"]: record for record in read_metrics(run_dir)}
    assert printed[0].startswith("artifact ") and "'run.json'" in printed[0]
    for line, step in zip(printed[1:], (1, 20)):
        imbalance = round(records[step]["moe.imbalance_per_layer"][0], 3)
        assert line == f"step {step} loss {records[step]['loss']} layer 0 imbalance {imbalance}"
