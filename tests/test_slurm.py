"""`ferry launch --scheduler slurm`'s sbatch file on a real Slurm (`slurm_cluster.py`): submitted, it trains, and
its run equals a local run of the same run.yaml step for step."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, TINY_RUN
from slurm_cluster import SlurmCluster


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()


def ferry(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "ferry", *args], capture_output=True, text=True, cwd=REPO, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_sbatch_file_trains_under_slurm_as_the_same_config_trains_here(slurm, stdlib_dataset, tmp_path):
    raw = copy.deepcopy(TINY_RUN)
    raw["data"]["sources"] = [{"name": "stdlib", "path": str(stdlib_dataset)}]
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(raw))
    job = tmp_path / "job"
    ferry(
        "launch", str(config), "--platform", "cpu", "--nodes", "1", "--scheduler", "slurm", "--out", str(job),
        f"run.dir={tmp_path / 'under-slurm'}", "parallel.ep=2", "train.steps=4", "metrics.sinks.prometheus.port=0",
    )  # fmt: skip
    # the job's environment is the submitter's (sbatch --export=ALL): torchrun and python are the suite's
    slurm.env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), slurm.env["PATH"]])
    submitted = slurm.run("sbatch", "--parsable", "--wait", str(job / "ferry.sbatch"), check=False)
    logs = "\n".join(path.read_text() for path in sorted((job / "logs").glob("*")))
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr + logs
    job_id = submitted.stdout.strip().split(";")[0]
    assert f"{raw['run']['name']}-{job_id}-node0.log" in {path.name for path in (job / "logs").iterdir()}
    assert "ferry: done" in logs

    ferry("train", str(job / "run.yaml"), "--nproc", "2", f"run.dir={tmp_path / 'here'}")
    here, under_slurm = losses(tmp_path / "here"), losses(tmp_path / "under-slurm")
    assert len(here) == 4 and under_slurm == here  # the same ranks, threads and data: the same numbers
