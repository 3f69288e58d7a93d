"""Every file of a checkpoint, an export and the reference log-prob cache takes the process's umask, as
`manifest.json` does: safetensors alone writes its tensor files 0600, which another account on a shared
filesystem (an evaluation job) cannot read."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from ferry.cli.main import main
from ferry.platform import file_modes
from ferry.train import Trainer
from ferry.train.objectives.reference import LogprobCache

UMASKS = {0o022: 0o644, 0o027: 0o640}


@pytest.fixture(params=sorted(UMASKS), ids=lambda umask: f"umask{umask:04o}")
def umask(request):
    """The process runs under this umask for the test; the previous one is restored after."""
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def _modes(directory: Path) -> dict[str, int]:
    files = (path for path in directory.rglob("*") if path.is_file())
    return {str(path.relative_to(directory)): stat.S_IMODE(path.stat().st_mode) for path in files}


def test_checkpoint_and_export_files_take_the_umask(umask, make_config, tmp_path, capsys):
    expected = UMASKS[umask]
    run_dir = tmp_path / "run"
    config = make_config(
        "model.qk_norm=true", "model.qk_norm_scope=head", "train.steps=2", "checkpoint.interval=1", run_dir=run_dir
    )
    Trainer(config).fit()
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"))
    assert [path.name for path in checkpoints] == ["step-00000001", "step-00000002"]
    for checkpoint in checkpoints:
        modes = _modes(checkpoint)
        assert any(name.endswith(".safetensors") for name in modes) and "manifest.json" in modes
        assert modes == dict.fromkeys(modes, expected), checkpoint
    out = tmp_path / "hf"
    assert main(["export", str(checkpoints[-1]), str(out)]) == 0
    modes = _modes(out)
    assert "model.safetensors" in modes and "config.json" in modes and "tokenizer.json" in modes
    assert modes == dict.fromkeys(modes, expected)


def test_the_reference_logprob_cache_takes_the_umask(umask, tmp_path):
    cache = LogprobCache(tmp_path / "cache", {"dataset": "prefs"})
    cache.save(torch.zeros(3, 2))
    assert stat.S_IMODE(cache.path.stat().st_mode) == UMASKS[umask]
    assert torch.equal(cache.load(), torch.zeros(3, 2, dtype=torch.float64))


def test_without_proc_the_umask_is_read_back_and_left_as_it_was(umask, monkeypatch, tmp_path):
    monkeypatch.setattr(file_modes, "_STATUS", tmp_path / "absent")
    assert file_modes.process_umask() == umask
    assert os.umask(umask) == umask
