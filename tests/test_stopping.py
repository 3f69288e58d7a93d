"""A run stopped from outside: SIGTERM or Ctrl-C is recorded as a stop, and ranks never outlive their launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO

TINY = str(REPO / "configs" / "tiny.yaml")


def _overrides(stdlib_dataset: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "model.vocab_size=512",
        f"data.sources.0.path={stdlib_dataset}",
        "eval.sources=[]",
        "train.steps=100000",
        "train.log_every=1",
        f"run.dir={run_dir}",
        *extra,
    ]


def _start(stdlib_dataset: Path, run_dir: Path, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "ferry", "train", TINY, *_overrides(stdlib_dataset, run_dir, *extra)]
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_a_step(process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    for line in process.stdout:
        if line.startswith("step"):
            return
        assert time.monotonic() < deadline, "no step within the time allowed"
    raise AssertionError(f"the run ended before its first step: {process.stderr.read()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state != "Z"


def test_sigterm_records_the_run_as_interrupted_and_ends_by_the_signal(stdlib_dataset, tmp_path):
    process = _start(stdlib_dataset, tmp_path / "run")
    _wait_for_a_step(process)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == -signal.SIGTERM, err  # a stop, as a launcher counts it, not a failure
    assert "ferry: stopped by SIGTERM" in err and "Traceback" not in err
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["status"] == "interrupted" and record["signal"] == "SIGTERM"
    assert record["last_step"]["step"] >= 1


def test_a_launcher_told_to_stop_stops_its_ranks_and_records_the_stop(stdlib_dataset, tmp_path):
    launcher = _start(stdlib_dataset, tmp_path / "run", "--nproc", "2")
    _wait_for_a_step(launcher)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == -signal.SIGTERM and "ferry: stopped by SIGTERM" in err and "Traceback" not in err
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["status"] == "interrupted" and record["signal"] == "SIGTERM"


def test_ranks_die_with_a_launcher_that_is_killed(stdlib_dataset, tmp_path):
    launcher = _start(stdlib_dataset, tmp_path / "run", "--nproc", "2")
    _wait_for_a_step(launcher)
    ranks = [
        int(pid)
        for pid in subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
    ]
    assert len(ranks) == 2
    launcher.kill()
    launcher.wait(timeout=60)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in ranks), "a rank trains on after its launcher was killed"


def test_a_second_run_in_a_live_runs_directory_is_refused_until_it_ends(stdlib_dataset, tmp_path):
    import pytest

    from ferry.config import UserError
    from ferry.train import load_run_config, train

    live = _start(stdlib_dataset, tmp_path / "run", "checkpoint.interval=1")
    _wait_for_a_step(live)
    resume = load_run_config(TINY, _overrides(stdlib_dataset, tmp_path / "run", "resume=latest", "train.stop_at=1"))
    with pytest.raises(UserError, match=rf"is in use by a live run \(pid {live.pid} on "):
        train(resume)
    live.send_signal(signal.SIGTERM)
    live.communicate(timeout=120)
    train(resume)  # the same run, now nobody else's: it goes on from the stopped run's newest checkpoint
    assert json.loads((tmp_path / "run" / "run.json").read_text())["resumed_from"]["step"] >= 1
