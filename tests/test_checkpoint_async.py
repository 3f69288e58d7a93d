"""Asynchronous saves on every layout, and storage faults that lose nothing.

A save copies each rank's pieces to host memory and writes them from a thread per rank while training goes on;
the main rank publishes once every rank's marker says its pieces are durable. A resumed run equals the
uninterrupted one bit for bit, as after a synchronous save. A write the storage refuses on one rank reaches every
rank at the next step's end, names the path and the error and what was kept, and publishes nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import distributed_training as runs
import pytest
import torch

from ferry.checkpoint import CheckpointMeta, Layout, SaveFailed, TensorPiece, list_checkpoints
from ferry.checkpoint.config import CheckpointConfig
from ferry.checkpoint.manager import CheckpointManager
from ferry.cli.main import main
from ferry.comm.spawn import run_on_ranks
from ferry.train import Trainer


@pytest.mark.parametrize(
    "layout",
    [("parallel.ep=2", "optim.zero=true"), ("parallel.mode=fsdp",), ("parallel.pp=2",)],
    ids=["ep2-zero", "fsdp", "pp2"],
)
def test_an_asynchronous_save_resumes_bit_for_bit_on_every_layout(stdlib_dataset, tmp_path, layout):
    whole = run_on_ranks(runs.train_run, 2, str(stdlib_dataset), str(tmp_path / "whole"), *layout)[0]
    record = json.loads((tmp_path / "whole" / "run.json").read_text())["checkpoint_async"]
    assert record["setting"] == "auto" and record["on"] is True and record["rule"].startswith("auto: on, 2 ranks")
    saves = [row for row in whole["records"] if row["checkpoint.blocked_s"] > 0]
    assert [row["step"] for row in saves] == [5, 10]
    assert any(row["checkpoint.write_s"] > 0 for row in whole["records"] if row["step"] > 5)
    checkpoint = tmp_path / "whole" / "checkpoints" / "step-00000005"
    resumed = run_on_ranks(
        runs.train_run, 2, str(stdlib_dataset), str(tmp_path / "resumed"), *layout, f"resume={checkpoint}"
    )[0]
    assert resumed["losses"] == whole["losses"][5:]
    assert [row["grad_norm"] for row in resumed["records"]] == [row["grad_norm"] for row in whole["records"][5:]]


FULL_ON_RANK_1 = "fault.inject=[{step: 4, rank: 1, kind: disk_full_during_save}]"


def test_a_full_disk_on_one_rank_stops_every_rank_and_keeps_the_previous_checkpoint(stdlib_dataset, tmp_path):
    ranks = run_on_ranks(
        runs.train_reporting_failure,
        2,
        str(stdlib_dataset),
        str(tmp_path),
        "parallel.ep=2",
        "optim.zero=true",
        "checkpoint.interval=2",
        FULL_ON_RANK_1,
    )
    root = tmp_path / "checkpoints"
    for rank in ranks:
        assert rank["error"].startswith("SaveFailed: the checkpoint of step 4 was not saved: rank 1 failed writing")
        assert "No space left on device" in rank["error"] and str(root / ".step-00000004.partial") in rank["error"]
        assert f"the newest complete checkpoint is {root / 'step-00000002'}" in rank["error"]
        assert rank["exit_code"] == 1
    assert [path.name for path in list_checkpoints(root)] == ["step-00000002"]
    assert not list(root.glob(".step-*")), "nothing partial is left to be mistaken for a checkpoint"
    assert main(["ckpt", "verify", str(root / "step-00000002")]) == 0


def test_with_on_failure_continue_training_goes_on_and_counts_the_failed_save(stdlib_dataset, tmp_path, capsys):
    straight = run_on_ranks(
        runs.train_run, 2, str(stdlib_dataset), str(tmp_path / "straight"), "parallel.ep=2", "checkpoint.interval=2"
    )[0]
    ranks = run_on_ranks(
        runs.train_run,
        2,
        str(stdlib_dataset),
        str(tmp_path / "run"),
        "parallel.ep=2",
        "checkpoint.interval=2",
        "checkpoint.on_failure=continue",
        FULL_ON_RANK_1,
    )
    assert ranks[0]["losses"] == straight["losses"]
    failed = [row["checkpoint.failed_saves"] for row in ranks[0]["records"]]
    known = failed.index(1) + 1  # the step whose record first counts it
    assert known in (5, 6), "a failure in the background reaches every rank within a step or two"
    assert failed == [0] * (known - 1) + [1] * (10 - known + 1)
    saved = [path.name for path in list_checkpoints(tmp_path / "run" / "checkpoints")]
    assert saved == ["step-00000002", "step-00000006", "step-00000008", "step-00000010"], "no step 4"


def test_a_synchronous_save_refused_permission_names_the_path_and_exits_1(stdlib_dataset, tmp_path, capsys):
    config = [f"data.sources=[{{name: stdlib, path: {stdlib_dataset}}}]", "model.vocab_size=512"]
    code = main(
        [
            "train",
            "configs/tiny.yaml",
            *config,
            f"run.dir={tmp_path}",
            "train.steps=4",
            "eval.sources=[]",
            "checkpoint.interval=2",
            "fault.inject=[{step: 4, kind: permission_denied_during_save}]",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1, err[-2000:]
    assert "ferry: error: the checkpoint of step 4 was not saved: rank 0 failed writing it (" in err
    assert f"{tmp_path / 'checkpoints' / '.step-00000004.partial' / 'manifest.json'}: Permission denied" in err
    assert [path.name for path in list_checkpoints(tmp_path / "checkpoints")] == ["step-00000002"]


def _mounted_tmpfs(mount, size_bytes: int) -> bool:
    mount.mkdir()
    options = f"size={size_bytes // 4096 * 4096}"
    return (
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], capture_output=True).returncode
        == 0
    )


def test_a_real_full_disk_fails_the_save_and_keeps_the_previous_checkpoint(make_config, tmp_path):
    """A tmpfs with room for one and a half checkpoints (where this machine lets the tests mount one): the save
    of step 2 fits, that of step 4 runs out of space."""
    Trainer(make_config("train.steps=2", "checkpoint.interval=2", run_dir=tmp_path / "measure")).fit()
    size = sum(path.stat().st_size for path in (tmp_path / "measure" / "checkpoints").rglob("*") if path.is_file())
    disk = tmp_path / "small"
    if not _mounted_tmpfs(disk, size * 3 // 2):
        pytest.skip("mounting a tmpfs is not allowed here")
    try:
        with pytest.raises(SaveFailed) as failed:
            Trainer(make_config("checkpoint.interval=2", f"checkpoint.dir={disk}", run_dir=tmp_path / "run")).fit()
        complete = list_checkpoints(disk)
        assert [path.name for path in complete] == ["step-00000002"]
        assert not list(disk.glob(".step-*")), "the partial save is cleared: the disk has room again"
        assert main(["ckpt", "verify", str(complete[-1])]) == 0
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    assert "the checkpoint of step 4 was not saved: rank 0 failed writing it" in str(failed.value)
    assert f"({disk / '.step-00000004.partial'}/" in str(failed.value), "the file the disk refused"
    assert "No space left on device" in str(failed.value)


def test_the_memory_model_counts_the_host_snapshot_where_saves_run_in_the_background(make_config):
    from ferry.train.memory import memory_estimate

    one, two = memory_estimate(make_config(), 1, "cpu"), memory_estimate(make_config(), 2, "cpu")
    assert one.snapshot_bytes == 0 and "snapshot" not in one.describe()
    parameters = sum(p.numel() for p in Trainer(make_config()).parts.model.model.parameters())
    assert two.snapshot_bytes == pytest.approx(parameters * 12, rel=0.05), "fp32 weights and AdamW's two moments"
    assert "in host memory an asynchronous checkpoint's snapshot" in two.describe()
    assert memory_estimate(make_config("checkpoint.async_save=false"), 2, "cpu").snapshot_bytes == 0


PIECES = {
    "model.w": TensorPiece.whole(torch.arange(4096.0).view(64, 64)),
    "optim.exp_avg.w": TensorPiece.whole(torch.ones(64, dtype=torch.bfloat16)),
}
META = CheckpointMeta(
    step=1,
    tokens_seen=0,
    layout=Layout(world_size=1, ep_degree=1, mode="single"),
    model_config={},
    run_config={},
    environment={},
    train_state={},
)


def _one_background_save(root, niceness: int) -> CheckpointManager:
    manager = CheckpointManager(CheckpointConfig(async_save=True, writer_niceness=niceness), root)
    manager.save(PIECES, META)
    manager.wait()
    return manager


def test_a_background_save_whose_lower_priority_is_refused_still_saves(tmp_path, monkeypatch):
    def refused(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refused)
    manager = _one_background_save(tmp_path, niceness=10)
    assert manager.saved == [tmp_path / "step-00000001"] == list_checkpoints(tmp_path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="niceness is a thread's own only on Linux")
def test_a_background_save_writes_at_a_lower_priority_than_training_down_to_its_helper_threads(tmp_path, monkeypatch):
    import ferry.checkpoint.writer as writer

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    seen = []
    write_file = writer.write_tensor_file

    def recording(path, tensors, *how):
        seen.append(niceness())
        return write_file(path, tensors, *how)

    monkeypatch.setattr(writer, "write_tensor_file", recording)
    training = niceness()
    manager = _one_background_save(tmp_path, niceness=7)
    assert manager.saved == [tmp_path / "step-00000001"] and len(seen) == 2
    assert seen == [min(19, training + 7)] * 2  # the files are written by threads the writer started
    assert niceness() == training  # training's own thread keeps its priority
