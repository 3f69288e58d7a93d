"""Every message, card and record that names a checkpoint's optimizer state reads which optimizer it is from the
checkpoint (`train_state.optimizer.kind`): a Muon run's release says Muon, and its average keeps Muon's momentum.
(What an import prints, naming no optimizer, is held by the docs' quoted output: tests/test_doc_commands.py.)"""

from __future__ import annotations

import json

import pytest

from ferry.checkpoint import list_checkpoints
from ferry.checkpoint.reader import verify_checkpoint
from ferry.cli.main import main
from ferry.config import UserError
from ferry.portability.release.replay import _start
from ferry.train import train


@pytest.fixture
def muon_run(make_config, tmp_path):
    run = tmp_path / "muon"
    train(make_config("optim.name=muon", "train.steps=4", "checkpoint.interval=2", run_dir=run))
    return run


def test_a_muon_runs_release_says_muon_in_its_messages_card_and_record(muon_run, tmp_path, capsys):
    capsys.readouterr()
    assert main(["release", str(muon_run), "--out", str(tmp_path / "with"), "--optimizer"]) == 0
    said = capsys.readouterr().out
    assert "step 4 checkpoint with Muon state" in said and "AdamW" not in said
    card = (tmp_path / "with" / "README.md").read_text()
    assert "final checkpoint's weights and Muon state." in card and "AdamW" not in card
    [stage] = json.loads((tmp_path / "with" / "release.json").read_text())["stages"]
    assert stage["checkpoint"]["optimizer"] and stage["checkpoint"]["optimizer_kind"] == "Muon"

    assert main(["release", str(muon_run), "--out", str(tmp_path / "without")]) == 0
    assert "step 4 checkpoint (weights)" in capsys.readouterr().out
    assert "(this release carries no optimizer state)" in (tmp_path / "without" / "README.md").read_text()
    [stage] = json.loads((tmp_path / "without" / "release.json").read_text())["stages"]
    assert not stage["checkpoint"]["optimizer"] and stage["checkpoint"]["optimizer_kind"] == "Muon"


def test_a_replay_that_needs_the_parents_muon_state_names_it(tmp_path):
    parent = {
        "name": "pretrain",
        "checkpoint": {
            "path": "stages/pretrain/checkpoints/step-00000004",
            "lineage_digest": "d",
            "optimizer": False,
            "optimizer_kind": "Muon",
        },
    }
    child = {
        "name": "midtrain",
        "parent": {"stage": "pretrain", "digest": "d", "checkpoint": "x"},
        "start": {"carry": "weights+optimizer", "steps": "fresh"},
    }
    with pytest.raises(
        UserError,
        match="starts from pretrain's weights and Muon state, and this release carries no "
        "optimizer state: release the pipeline with --optimizer",
    ):
        _start(tmp_path, {"stages": [parent, child]}, child, "midtrain")


def test_averaging_muon_checkpoints_averages_their_momentum_and_refuses_another_optimizers(
    muon_run, make_config, tmp_path, capsys
):
    early, late = list_checkpoints(muon_run / "checkpoints")
    assert (
        main(["ckpt", "average", str(early), str(late), "--out", str(tmp_path / "soup"), "--optimizer", "average"]) == 0
    )
    [soup] = list_checkpoints(tmp_path / "soup")
    averaged, first, second = (verify_checkpoint(path) for path in (soup, early, late))
    momentum = [name for name in first.names("optim.momentum_buffer.")]
    assert momentum and set(momentum) <= set(averaged.names())
    for name in momentum[:3]:
        expected = (first.read(name).double() + second.read(name).double()) / 2
        assert averaged.read(name).double().allclose(expected, rtol=0, atol=1e-7), name
    assert averaged.manifest.train_state["optimizer"]["kind"] == "Muon"

    adamw = tmp_path / "adamw"
    train(make_config("train.steps=2", run_dir=adamw))
    [adamw_checkpoint] = list_checkpoints(adamw / "checkpoints")
    capsys.readouterr()
    assert (
        main(
            [
                "ckpt",
                "average",
                str(late),
                str(adamw_checkpoint),
                "--out",
                str(tmp_path / "mixed"),
                "--optimizer",
                "average",
            ]
        )
        == 2
    )
    assert "holds AdamW optimizer state and" in capsys.readouterr().err and not (tmp_path / "mixed").exists()
