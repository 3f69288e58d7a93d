"""The trainer: determinism, batch-split invariance, run records, and that it learns."""

import json

import pytest
import yaml
from conftest import REPO

from ferry.config import UserError
from ferry.train import Trainer, load_run_config, train

METRIC_KEYS = {"step", "loss", "lm_loss", "aux_loss", "z_loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_s"}


def test_same_seed_and_config_give_bitwise_identical_losses(make_config, tmp_path):
    first = train(make_config(run_dir=tmp_path / "a")).losses
    second = train(make_config(run_dir=tmp_path / "b")).losses
    assert first == second
    assert len(first) == 6


def test_a_different_seed_gives_different_losses(make_config, tmp_path):
    first = train(make_config(run_dir=tmp_path / "a")).losses
    other = train(make_config("run.seed=1", run_dir=tmp_path / "b")).losses
    assert first != other


def test_gradient_accumulation_keeps_the_global_batch_result(make_config, tmp_path):
    # The switch aux loss is a product of per-micro-batch means (as in Megatron), so it alone
    # depends on the split; every other term is a token mean and must not.
    common = ("train.steps=3", "model.moe.aux_loss_coef=0")
    whole = Trainer(make_config("train.micro_batch=8", *common, run_dir=tmp_path / "a"))
    split = Trainer(make_config("train.micro_batch=2", *common, run_dir=tmp_path / "b"))
    for _ in range(3):
        a, b = whole.train_step(), split.train_step()
        assert a["lm_loss"] == pytest.approx(b["lm_loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    for p, q in zip(whole.model.parameters(), split.model.parameters()):
        assert (p - q).abs().max() < 1e-5


def test_run_directory_holds_config_manifest_and_metrics(make_config, tmp_path):
    config = make_config(run_dir=tmp_path / "run")
    result = train(config)
    run_dir = tmp_path / "run"
    assert load_run_config(run_dir / "config.yaml") == config
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7))
    assert all(METRIC_KEYS <= set(r) for r in records)
    assert records[-1]["tokens"] == 6 * 8 * 32
    assert [r["loss"] for r in records] == result.losses
    manifest = json.loads((run_dir / "run.json").read_text())
    assert manifest["status"] == "completed"
    assert manifest["config"] == config.model_dump(mode="json")
    mix = manifest["data_mix"][0]
    assert mix["name"] == "stdlib" and len(mix["shards"][0]["sha256"]) == 64 and mix["sources"]
    env = manifest["environment"]
    assert {"python", "torch", "device_type", "code"} <= set(env)
    assert env["code"]["ferry"]


def test_an_earlier_run_is_not_overwritten_unless_asked(make_config, tmp_path):
    train(make_config(run_dir=tmp_path / "run"))
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(UserError, match="run.overwrite=true"):
        train(make_config(run_dir=tmp_path / "run"))
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before
    train(make_config("run.overwrite=true", run_dir=tmp_path / "run"))


def test_model_vocabulary_must_cover_the_tokenizer(make_config):
    with pytest.raises(UserError, match="model.vocab_size"):
        Trainer(make_config("model.vocab_size=100"))


def test_the_tiny_demo_config_learns(stdlib_dataset, tmp_path):
    """The demo config on (a slice of) the embedded corpus: loss falls by well over 30% in 120 steps."""
    config = load_run_config(
        REPO / "configs" / "tiny.yaml",
        [f"data.sources.0.path={stdlib_dataset}", "model.vocab_size=512", "train.steps=120", f"run.dir={tmp_path}"],
    )
    losses = train(config).losses
    assert losses[-1] < 0.7 * losses[0], (losses[0], losses[-1])


def test_the_demo_config_is_valid_yaml_with_the_documented_sections():
    raw = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    assert set(raw) == {"run", "model", "data", "train", "optim"}


def test_a_run_its_warm_up_does_not_fit_is_warned_before_it_trains(make_config, tmp_path, capsys):
    """`train.steps=30` with a 30-step warm-up ends at the peak learning rate: the run says so, naming both
    settings; a schedule that runs its course says nothing."""
    train(make_config("train.steps=2", "optim.warmup_steps=2", run_dir=tmp_path / "short"))
    out = capsys.readouterr().out
    assert (
        "ferry: warning: optim.warmup_steps (2) is not below train.steps (2): the whole run is warm-up, its last "
        "step at learning rate 3.00e-03 (optim.lr 3.00e-03), and the cosine decay never starts"
    ) in out
    train(make_config("train.steps=3", "optim.warmup_steps=2", run_dir=tmp_path / "peak"))
    assert "optim.schedule cosine ends at 3.00e-03, not at its floor 3.00e-04" in capsys.readouterr().out
    train(make_config("train.steps=4", "optim.warmup_steps=2", run_dir=tmp_path / "whole"))
    assert "warning" not in capsys.readouterr().out
