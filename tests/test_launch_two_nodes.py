"""Two nodes on one host, for real: two torchrun agents started with the scripts `ferry launch
--scheduler torchrun` renders (c10d rendezvous on 127.0.0.1, and the static form), one gloo rank each,
train the tiny MoE with expert parallelism over the two "nodes"; the losses equal the same job run as
two ranks of one node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import TINY_RUN

from ferry.cli.main import main
from ferry.comm.spawn import free_port
from ferry.metrics import read_metrics
from ferry.train.resilience.restarts import CAUSES_DIR, read_events

TIMEOUT_S = 240


def _config_file(stdlib_dataset, tmp_path: Path) -> Path:
    raw = yaml.safe_load(yaml.safe_dump(TINY_RUN))
    raw["data"]["sources"] = [{"name": "stdlib", "path": str(stdlib_dataset)}]
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _losses(run_dir: Path) -> list[float]:
    return [record["loss"] for record in read_metrics(run_dir)]


def _run_nodes(scripts: list[Path], logs: Path) -> None:
    """Start every node's script at once, as a cluster would; any failure shows every node's output."""
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    environment.pop("WORLD_SIZE", None)
    logs.mkdir()
    nodes = []
    for index, script in enumerate(scripts):
        with open(logs / f"node{index}.log", "w") as log:
            nodes.append(subprocess.Popen(["bash", str(script)], env=environment, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [node.wait(timeout=TIMEOUT_S) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    outputs = [(logs / f"node{index}.log").read_text()[-3000:] for index in range(len(nodes))]
    assert codes == [0] * len(nodes), "\n\n".join(
        f"node {i} exited {c}:\n{o}" for i, (c, o) in enumerate(zip(codes, outputs))
    )


@pytest.fixture(scope="module")
def one_node_losses(stdlib_dataset, tmp_path_factory) -> list[float]:
    """The reference: the same job as two ranks of one node (`ferry train --nproc 2`)."""
    tmp_path = tmp_path_factory.mktemp("one-node")
    config = _config_file(stdlib_dataset, tmp_path)
    run_dir = tmp_path / "run"
    overrides = ["parallel.ep=2", f"run.dir={run_dir}", "resume=latest"]
    assert main(["train", str(config), "--nproc", "2", *overrides]) == 0
    environment = json.loads((run_dir / "run.json").read_text())["environment"]
    assert environment["cpu_threads"] == 1, "two ranks on one node: one thread each, as torchrun's command sets"
    return _losses(run_dir)


@pytest.mark.parametrize("rendezvous, restart", [("c10d", False), ("static", False), ("c10d", True)])
def test_two_torchrun_nodes_on_one_host_train_as_two_ranks_of_one_node(
    rendezvous, restart, one_node_losses, stdlib_dataset, tmp_path
):
    """With `restart`, rank 1 is killed at step 5: torchrun restarts both nodes' workers, which meet again
    and resume from the step-4 checkpoint; every step's loss still equals the uninterrupted job's. (With a
    background save the step-4 checkpoint may be cut short by the kill and the job resume from step 2:
    `tests/test_faults.py` covers kills during background writes.)"""
    config = _config_file(stdlib_dataset, tmp_path)
    out, run_dir = tmp_path / "launch", tmp_path / "run"
    argv = [
        "launch",
        str(config),
        "--platform",
        "cpu",
        "--nodes",
        "2",
        "--nproc-per-node",
        "1",
        "--scheduler",
        "torchrun",
        "--rendezvous",
        rendezvous,
        "--master-addr",
        "127.0.0.1",
        "--port",
        str(free_port()),
        "--max-restarts",
        "1" if restart else "0",
        "--out",
        str(out),
        "parallel.ep=2",
        f"run.dir={run_dir}",
        "metrics.sinks.prometheus.enabled=false",
    ]
    if restart:  # saved in the foreground: a kill at the step after a background save may cut that save short
        argv += [
            "checkpoint.interval=2",
            "checkpoint.async_save=false",
            "fault.inject=[{step: 5, rank: 1, kind: kill}]",
        ]
    assert main(argv) == 0
    scripts = sorted(out.glob("torchrun-node*.sh"))
    assert [script.name for script in scripts] == ["torchrun-node0.sh", "torchrun-node1.sh"]
    _run_nodes(scripts, tmp_path / "logs")
    if restart:
        assert "resuming from" in "".join(path.read_text() for path in (tmp_path / "logs").glob("*.log"))
        # only node 1's agent counted the restart; rank 0, on node 0, records it all the same
        record = json.loads((run_dir / "run.json").read_text())
        assert record["status"] == "completed"
        (restarted,) = record["restarts"]
        assert restarted["by"] == "torchrun"
        assert restarted["cause"].startswith("rank 1 left no report"), restarted["cause"]
        assert (restarted["failed_at_step"], restarted["resumed_from_step"], restarted["steps_lost"]) == (4, 4, 0)
        assert restarted["restart_latency_s"] > 0
        assert record["goodput"]["restarts"] == 1 and record["goodput"]["restarting_s"] > 0
        assert [event["event"] for event in read_events(run_dir)] == ["start", "failure", "restored", "resumed"]
        assert not list((run_dir / CAUSES_DIR).glob("*.json")), "every rank's report went into the record"
    by_step = {record["step"]: record["loss"] for record in read_metrics(run_dir)}  # a resumed step's last record
    assert sorted(by_step) == list(range(1, TINY_RUN["train"]["steps"] + 1))
    assert [by_step[step] for step in sorted(by_step)] == one_node_losses
