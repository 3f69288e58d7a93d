"""`ferry ckpt average`: the weighted mean of two checkpoints tensor by tensor (optimizer moments when
asked), usable as `init_from`; checkpoints of another model and bad weights are refused (exit 2)."""

from __future__ import annotations

import pytest
import torch

from ferry.checkpoint import verify_checkpoint
from ferry.cli.main import main
from ferry.train import Trainer
from ferry.train.restore import initialize_from


@pytest.fixture(scope="module")
def two_checkpoints(stdlib_dataset, tmp_path_factory):
    from conftest import tiny_config

    run_dir = tmp_path_factory.mktemp("average") / "run"
    Trainer(tiny_config(stdlib_dataset, run_dir, "train.steps=4", "checkpoint.interval=2", "checkpoint.keep=2")).fit()
    return run_dir / "checkpoints" / "step-00000002", run_dir / "checkpoints" / "step-00000004"


def test_the_average_is_the_weighted_mean_of_every_model_tensor(two_checkpoints, tmp_path, capsys):
    early, late = two_checkpoints
    assert main(["ckpt", "average", str(early), str(late), "--out", str(tmp_path / "soup"), "--weights", "1,3"]) == 0
    assert "weights 0.25, 0.75; optimizer state dropped" in capsys.readouterr().out
    soup, a, b = (verify_checkpoint(path) for path in (tmp_path / "soup" / "step-00000004", early, late))
    assert soup.names() == a.names("model.")
    for name in soup.names():
        expected = (0.25 * a.read(name).double() + 0.75 * b.read(name).double()).float()
        assert torch.equal(soup.read(name), expected), name
    assert soup.manifest.train_state["averaged"]["from"] == [str(early), str(late)]


def test_optimizer_moments_are_averaged_when_asked(two_checkpoints, tmp_path):
    early, late = two_checkpoints
    assert (
        main(["ckpt", "average", str(early), str(late), "--out", str(tmp_path / "soup"), "--optimizer", "average"]) == 0
    )
    soup, a, b = (verify_checkpoint(path) for path in (tmp_path / "soup" / "step-00000004", early, late))
    moments = soup.names("optim.exp_avg")
    assert moments and set(moments) == set(a.names("optim.exp_avg"))
    for name in moments:
        assert torch.equal(soup.read(name), ((a.read(name).double() + b.read(name).double()) / 2).float())
    steps = soup.names("optim.step.")
    assert steps and all(soup.read(name).item() == b.read(name).item() for name in steps)


def test_a_run_starts_from_the_average(two_checkpoints, make_config, tmp_path):
    early, late = two_checkpoints
    assert main(["ckpt", "average", str(early), str(late), "--out", str(tmp_path / "soup")]) == 0
    losses = Trainer(make_config("train.steps=1", f"init_from={tmp_path / 'soup' / 'step-00000004'}")).fit().losses
    assert len(losses) == 1


def test_another_model_and_bad_weights_exit_2(two_checkpoints, make_config, tmp_path, capsys):
    early, late = two_checkpoints
    other = make_config("train.steps=1", "model.dim=48", run_dir=tmp_path / "other")
    Trainer(other).fit()
    wider = tmp_path / "other" / "checkpoints" / "step-00000001"
    assert main(["ckpt", "average", str(early), str(wider), "--out", str(tmp_path / "x")]) == 2
    assert "model.dim" in capsys.readouterr().err
    assert main(["ckpt", "average", str(early), str(late), "--out", str(tmp_path / "y"), "--weights", "1"]) == 2
    assert "--weights" in capsys.readouterr().err
    assert main(["ckpt", "average", str(early), "--out", str(tmp_path / "z")]) == 2
    assert "at least two" in capsys.readouterr().err
    assert main(["ckpt", "average", str(early), str(late), "--out", str(tmp_path / "n"), "--weights", "nan,1"]) == 2
    assert "--weights" in capsys.readouterr().err and not (tmp_path / "n").exists()
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_init_optimizer_starts_from_the_checkpoints_adamw_state(two_checkpoints, make_config, tmp_path):
    from ferry.config import UserError

    early, late = two_checkpoints
    trainer = Trainer(make_config("train.steps=1", f"init_from={late}", "init_optimizer=true"))
    _, notes = initialize_from(trainer.parts.job, trainer.parts.model, late)
    assert "weights and optimizer state initialised" in notes[0]
    stored = verify_checkpoint(late)
    for name, param in trainer.model.named_parameters():
        state = trainer.optimizer.state[param]
        assert torch.equal(state["exp_avg"], stored.read(f"optim.exp_avg.{name}")), name
        assert state["step"].item() == stored.read(f"optim.step.{name}").item() == 4
    assert main(["ckpt", "average", str(early), str(late), "--out", str(tmp_path / "soup")]) == 0
    weights_only = Trainer(make_config("train.steps=1", f"init_from={tmp_path / 'soup'}", "init_optimizer=true"))
    with pytest.raises(UserError, match="holds no optimizer state"):
        weights_only.fit()


@pytest.mark.parametrize("optimizer", ["drop", "average"])
def test_an_average_is_refused_as_a_resume_and_the_message_says_how_to_start_from_it(
    two_checkpoints, make_config, tmp_path, optimizer
):
    from ferry.config import UserError

    early, late = two_checkpoints
    assert (
        main(["ckpt", "average", str(early), str(late), "--out", str(tmp_path / "soup"), "--optimizer", optimizer]) == 0
    )
    soup = tmp_path / "soup" / "step-00000004"
    missing = "data position, RNG state" if optimizer == "average" else "optimizer state, data position, RNG state"
    start = f"init_from={soup} init_optimizer=true" if optimizer == "average" else f"init_from={soup}"
    trainer = Trainer(make_config("train.steps=6", f"resume={soup}", run_dir=tmp_path / "run"))
    with pytest.raises(UserError, match=f"holds no {missing}: .* start from it with {start}$"):
        trainer.fit()
