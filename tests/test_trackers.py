"""Experiment trackers (`metrics.trackers`) with their real libraries, offline: W&B in offline mode, read back with
W&B's own record reader (`wandb.sdk.internal.datastore.DataStore`, which W&B 0.19-0.29 ship; its public API cannot
read an offline run, and 0.30 dropped the Python reader: the dev extra pins `wandb>=0.19,<0.30`), and MLflow with
a SQLite store read back through `MlflowClient`. A tracker that fails (a closed port, a store it cannot write, a
fault in ferry's own adapter) leaves training to go on: a warning and a counter."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2
from wandb.sdk.internal.datastore import DataStore

from ferry.metrics.jsonl import read_metrics
from ferry.train import Trainer


@pytest.fixture(autouse=True)
def _no_reports_to_wandb(monkeypatch):
    """W&B sends its own errors to its crash reporter by default; the suite runs offline."""
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")


def _wandb_records(run_dir: Path, run_id: str) -> tuple[dict[int, dict], list[dict], list]:
    """Every offline W&B file of run `run_id` under `run_dir` (one per attempt), read record by record: the history
    by step, the config updates and the files of its artifacts."""
    history, configs, files = {}, [], []
    for path in sorted(run_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")):
        store = DataStore()
        store.open_for_scan(str(path))
        while (data := store.scan_data()) is not None:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                history.setdefault(int(items["_step"]), items)
            elif kind == "run":
                configs.append({item.key: json.loads(item.value_json) for item in record.run.config.update})
            elif kind == "artifact":
                files += [entry.path for entry in record.artifact.manifest.contents]
    return history, configs, files


def test_wandb_offline_gets_every_step_the_config_and_the_files_and_a_restart_continues_its_run(make_config, tmp_path):
    run_dir = tmp_path / "run"
    first = make_config(
        "metrics.trackers=[wandb]",
        "metrics.wandb.mode=offline",
        "train.steps=4",
        "checkpoint.interval=2",
        run_dir=run_dir,
    )
    Trainer(first).fit()
    ids = json.loads((run_dir / "trackers.json").read_text())
    records = read_metrics(run_dir)
    assert all(record["tracker_failures"] == 0 for record in records)
    history, configs, files = _wandb_records(run_dir, ids["wandb"])
    assert [history[record["step"]]["loss"] for record in records] == [record["loss"] for record in records]
    assert history[1]["moe.imbalance_per_layer/layer0"] == records[0]["moe.imbalance_per_layer"][0]
    assert configs[0]["model"]["dim"] == 32 and configs[0]["train"]["steps"] == 4
    assert {"run.json", "plots/loss.png"} <= set(files)

    # W&B names an offline attempt's directory by the second it started and the run id: an attempt that started in
    # the first one's second would write into its directory (a restart takes seconds; this test does not)
    time.sleep(1.0 - time.time() % 1.0)
    resumed = make_config(
        "metrics.trackers=[wandb]", "metrics.wandb.mode=offline", "train.steps=6", "resume=latest", run_dir=run_dir
    )
    Trainer(resumed).fit()
    assert json.loads((run_dir / "trackers.json").read_text()) == ids, "the resumed run continues the W&B run"
    history, _, _ = _wandb_records(run_dir, ids["wandb"])
    assert len(list(run_dir.glob(f"wandb/offline-run-*-{ids['wandb']}"))) == 2, "one directory per attempt"
    assert sorted(history) == [1, 2, 3, 4, 5, 6]
    assert history[6]["loss"] == read_metrics(run_dir)[-1]["loss"]


def test_mlflow_in_sqlite_gets_every_step_the_parameters_and_the_artifacts(make_config, tmp_path):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    trackers = ("metrics.trackers=[mlflow]", f"metrics.mlflow.tracking_uri={store}", "metrics.mlflow.experiment=tiny")
    Trainer(make_config(*trackers, "train.steps=3", "checkpoint.interval=3", run_dir=run_dir)).fit()
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=store)
    records = read_metrics(run_dir)
    losses = {metric.step: metric.value for metric in client.get_metric_history(run_id, "loss")}
    assert losses == {record["step"]: pytest.approx(record["loss"]) for record in records}
    run = client.get_run(run_id)
    assert run.data.params["model.dim"] == "32" and run.data.params["optim.name"] == "adamw"
    assert run.data.tags["run.status"] == "completed" and run.info.status == "FINISHED"
    artifacts = {artifact.path for artifact in client.list_artifacts(run_id)}
    assert "run.json" in artifacts and {a.path for a in client.list_artifacts(run_id, "plots")} >= {"plots/loss.png"}

    Trainer(make_config(*trackers, "train.steps=5", "resume=latest", run_dir=run_dir)).fit()
    assert json.loads((run_dir / "trackers.json").read_text())["mlflow"] == run_id
    assert sorted(metric.step for metric in client.get_metric_history(run_id, "loss")) == [1, 2, 3, 4, 5]


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_trackers_that_fail_leave_training_to_go_on_with_a_warning_and_a_counter(
    make_config, tmp_path, capsys, monkeypatch
):
    """W&B online against a closed port on 127.0.0.1 (it gives up after its init timeout, on its own thread), and
    MLflow on a store under /proc, which not even root may write: the run trains every step as without them."""
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    run_dir = tmp_path / "run"
    config = make_config(
        "metrics.trackers=[wandb, mlflow]",
        f"metrics.wandb.base_url=http://127.0.0.1:{_closed_port()}",
        "metrics.wandb.init_timeout_s=2",
        "metrics.tracker_timeout_s=10",
        "metrics.mlflow.tracking_uri=sqlite:////proc/ferry-cannot-write-here/mlflow.db",
        "train.steps=4",
        run_dir=run_dir,
    )
    result = Trainer(config).fit()
    plain = Trainer(make_config("train.steps=4", run_dir=tmp_path / "plain")).fit()
    assert result.losses == plain.losses
    err = capsys.readouterr()
    said = err.out + err.err
    assert "ferry: warning: tracker wandb failed (CommError" in said
    assert "ferry: warning: tracker mlflow failed (" in said
    assert "training goes on" in said
    outcomes = json.loads((run_dir / "run.json").read_text())["trackers"]
    assert outcomes["wandb"]["failures"] >= 1 and outcomes["wandb"]["run_id"] is None
    assert (
        outcomes["mlflow"]["failures"] >= 1 and "/proc/ferry-cannot-write-here" in outcomes["mlflow"]["first_failure"]
    )
    assert all("tracker_failures" in record for record in read_metrics(run_dir))
    assert not (run_dir / "trackers.json").exists()


def test_a_fault_in_the_adapter_drops_that_tracker_only(make_config, tmp_path, capsys, monkeypatch):
    """A fault injected into ferry's own adapter (its `log` raises at step 2): the warning once, the counter counts
    every record the tracker no longer takes, and the other tracker gets every step."""
    from ferry.metrics.wandb_tracker import WandbTracker

    log = WandbTracker.log

    def failing(self, step, values):
        if step >= 2:
            raise OSError(28, "No space left on device")
        log(self, step, values)

    monkeypatch.setattr(WandbTracker, "log", failing)
    run_dir = tmp_path / "run"
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    Trainer(
        make_config(
            "metrics.trackers=[wandb, mlflow]",
            "metrics.wandb.mode=offline",
            f"metrics.mlflow.tracking_uri={store}",
            "train.steps=4",
            run_dir=run_dir,
        )
    ).fit()
    said = capsys.readouterr()
    assert (said.out + said.err).count("ferry: warning: tracker wandb failed (OSError: [Errno 28]") == 1
    outcome = json.loads((run_dir / "run.json").read_text())["trackers"]["wandb"]
    assert outcome["failures"] == 3, "step 2 failed, steps 3 and 4 were not taken"
    assert outcome["first_failure"] == "OSError: [Errno 28] No space left on device"
    from mlflow.tracking import MlflowClient

    ids = json.loads((run_dir / "trackers.json").read_text())
    assert set(ids) == {"wandb", "mlflow"}, "each tracker's thread keeps its id beside the other's"
    assert len(MlflowClient(tracking_uri=store).get_metric_history(ids["mlflow"], "loss")) == 4


def test_only_rank_0_logs_on_two_ranks(stdlib_dataset, tmp_path):
    import distributed_training as runs

    from ferry.comm.spawn import run_on_ranks

    run_dir = tmp_path / "run"
    run_on_ranks(
        runs.train_run,
        2,
        str(stdlib_dataset),
        str(run_dir),
        "parallel.ep=2",
        "train.steps=2",
        "metrics.trackers=[wandb]",
        "metrics.wandb.mode=offline",
    )
    assert len(list(run_dir.glob("wandb/offline-run-*"))) == 1


def test_a_tracker_not_installed_is_refused_with_its_install_command(make_config, tmp_path, monkeypatch):
    import sys

    from ferry.config import UserError

    for module in ("mlflow", "mlflow.tracking", "mlflow.entities"):  # as if never installed: importing it fails
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(
        UserError,
        match=r"the mlflow package is not installed; install it with: pip install "
        r"'ferry-moe\[mlflow\]'",
    ):
        Trainer(make_config("metrics.trackers=[mlflow]", run_dir=tmp_path / "run")).fit()
    assert not (tmp_path / "run" / "run.json").exists(), "refused before the run directory is touched"
