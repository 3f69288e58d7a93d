"""Resuming a run: it continues exactly, falls back past a corrupt checkpoint, survives SIGKILL mid-save."""

import json
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO

from ferry.checkpoint import list_checkpoints, verify_checkpoint
from ferry.cli.main import main
from ferry.config import ConfigError, UserError, dump_yaml
from ferry.train import Trainer

EXACT = ("train.steps=20", "model.moe.bias_balancing.enabled=true")


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _optimizer_state_by_name(trainer):
    names = {param: name for name, param in trainer.model.named_parameters()}
    return {names[param]: state for param, state in trainer.optimizer.state.items()}


def test_a_resumed_run_equals_the_uninterrupted_run_bitwise(make_config, tmp_path):
    """(a) 20 steps straight vs 10 steps, stop, resume, 10 steps: same losses, weights, moments, bias."""
    straight = Trainer(make_config(*EXACT, run_dir=tmp_path / "straight"))
    expected = straight.fit().losses

    stopped_dir = tmp_path / "stopped"
    saving = ("checkpoint.interval=4", "checkpoint.keep=2", "checkpoint.async_save=true")
    first = Trainer(make_config(*EXACT, *saving, run_dir=stopped_dir)).fit(stop_at=10)
    assert [p.name for p in list_checkpoints(stopped_dir / "checkpoints")] == ["step-00000008", "step-00000010"]
    resumed = Trainer(make_config(*EXACT, *saving, "resume=latest", run_dir=stopped_dir))
    second = resumed.fit()

    assert first.losses + second.losses == expected
    assert [record["loss"] for record in _metrics(stopped_dir)] == expected
    assert resumed.cursor == straight.cursor
    for name, tensor in straight.model.state_dict().items():
        assert torch.equal(tensor, resumed.model.state_dict()[name]), name
    biases = [tensor for name, tensor in straight.model.state_dict().items() if name.endswith("expert_bias_E")]
    assert biases and all(bias.abs().sum() > 0 for bias in biases), "bias balancing must have moved the biases"
    straight_state, resumed_state = _optimizer_state_by_name(straight), _optimizer_state_by_name(resumed)
    assert straight_state.keys() == resumed_state.keys()
    for name, state in straight_state.items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], resumed_state[name][key]), (name, key)
    record = json.loads((stopped_dir / "run.json").read_text())
    assert record["status"] == "completed"
    assert record["resumed_from"]["step"] == 10 and record["resumed_from"]["checkpoint"].endswith("step-00000010")


def test_train_stop_at_stops_like_a_preempted_run_and_resume_records_what_it_carried(make_config, tmp_path):
    """The schedule spans train.steps whatever the stop; run.json says which state came back and what it cost."""
    expected = Trainer(make_config("train.steps=8", run_dir=tmp_path / "straight")).fit().losses
    run_dir = tmp_path / "run"
    first = Trainer(make_config("train.steps=8", "train.stop_at=3", run_dir=run_dir)).fit()
    stopped = json.loads((run_dir / "run.json").read_text())
    assert len(first.losses) == 3 and stopped["status"] == "stopped"
    assert [path.name for path in list_checkpoints(run_dir / "checkpoints")] == ["step-00000003"]
    assert stopped["started_at"] and stopped["first_step_at_unix"] <= time.time()
    second = Trainer(make_config("train.steps=8", "train.stop_at=3", "resume=latest", run_dir=run_dir)).fit(stop_at=8)
    assert first.losses + second.losses == expected
    resumed = json.loads((run_dir / "run.json").read_text())["resumed_from"]
    assert resumed["step"] == 3 and resumed["verify_s"] > 0 and resumed["restore_s"] > 0
    assert resumed["carried"]["weights"] == "carried" and resumed["carried"]["rng"] == "carried"
    assert resumed["carried"]["schedule"] == "carried (continues at step 3 of 8)"
    assert resumed["carried"]["loss_scaler"] == "carried (none in use)"


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one_with_a_warning(make_config, tmp_path, capsys):
    """(c)"""
    run_dir = tmp_path / "run"
    saving = ("checkpoint.interval=2", "checkpoint.keep=3")
    Trainer(make_config("train.steps=8", *saving, run_dir=run_dir)).fit(stop_at=6)
    newest = run_dir / "checkpoints" / "step-00000006"
    optim_file = newest / "optim-rank00000-part0000.safetensors"
    with open(optim_file, "r+b") as handle:
        handle.truncate(optim_file.stat().st_size // 2)
    capsys.readouterr()

    Trainer(make_config("train.steps=8", *saving, "resume=latest", run_dir=run_dir)).fit()
    out = capsys.readouterr().out
    assert f"warning: skipping checkpoint {newest}" in out and "bytes where the manifest says" in out
    assert "resuming from" in out and "step-00000004 at step 4" in out
    record = json.loads((run_dir / "run.json").read_text())
    assert record["resumed_from"]["step"] == 4
    assert record["resumed_from"]["skipped"][0]["checkpoint"] == str(newest)
    assert [r["step"] for r in _metrics(run_dir)] == list(range(1, 9))
    verify_checkpoint(newest)


def test_a_rollback_sets_the_abandoned_branch_aside_and_latest_follows_the_new_one(make_config, tmp_path, capsys):
    """Resuming at step 2 of a run that saved up to step 6: the checkpoints of steps 4 and 6 are moved out of
    the way (kept), so the new branch's saves are what `resume=latest` and pruning see."""
    run_dir = tmp_path / "run"
    saving = ("train.steps=8", "checkpoint.interval=2", "checkpoint.keep=2")
    Trainer(make_config(*saving, run_dir=run_dir)).fit(stop_at=6)
    checkpoints = run_dir / "checkpoints"
    assert [p.name for p in list_checkpoints(checkpoints)] == ["step-00000004", "step-00000006"]
    Trainer(make_config(*saving, run_dir=tmp_path / "short")).fit(stop_at=2)
    branch_point = tmp_path / "short" / "checkpoints" / "step-00000002"
    capsys.readouterr()

    changed = ("optim.lr=1e-3", "checkpoint.interval=1")
    Trainer(make_config(*saving, *changed, f"resume={branch_point}", run_dir=run_dir)).fit(stop_at=3)
    out = capsys.readouterr().out
    assert "goes on from step 2; the checkpoints it leaves behind (step-00000004, step-00000006)" in out
    (folder,) = (checkpoints / "abandoned").iterdir()
    assert folder.name.startswith("resumed-at-step-00000002-")
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000004", "step-00000006"]
    verify_checkpoint(folder / "step-00000006")  # kept whole
    assert [p.name for p in list_checkpoints(checkpoints)] == ["step-00000003"]
    record = json.loads((run_dir / "run.json").read_text())
    assert record["abandoned_checkpoints"] == {
        str(checkpoints / name): str(folder / name) for name in ("step-00000004", "step-00000006")
    }

    straight = Trainer(make_config(*saving, *changed, f"resume={branch_point}", run_dir=tmp_path / "b")).fit()
    resumed = Trainer(make_config(*saving, *changed, "resume=latest", run_dir=run_dir)).fit()
    assert "resuming from" in capsys.readouterr().out
    assert resumed.losses == straight.losses[1:]
    assert [r["step"] for r in _metrics(run_dir)] == list(range(1, 9))
    assert [p.name for p in list_checkpoints(checkpoints)] == ["step-00000007", "step-00000008"]


def test_a_pickle_planted_in_the_newest_checkpoint_makes_resume_fall_back_without_running_it(
    make_config, tmp_path, capsys
):
    class Plant:
        def __reduce__(self):
            return (exec, (f"open({str(tmp_path / 'marker')!r}, 'w').write('pickle code ran')",))

    run_dir = tmp_path / "run"
    Trainer(make_config("train.steps=3", "checkpoint.interval=1", run_dir=run_dir)).fit(stop_at=2)
    (run_dir / "checkpoints" / "step-00000002" / "extra_state.pt").write_bytes(pickle.dumps(Plant()))
    Trainer(make_config("train.steps=3", "checkpoint.interval=1", "resume=latest", run_dir=run_dir)).fit()
    out = capsys.readouterr().out
    assert "skipping checkpoint" in out and "extra_state.pt" in out
    assert "step-00000001 at step 1" in out
    assert not (tmp_path / "marker").exists()


_KILLED_MID_SAVE = """
import sys, time
from pathlib import Path
import ferry.checkpoint.writer as writer
from ferry.train import Trainer, load_run_config

config_path, signal_path = sys.argv[1:]
write_file = writer.write_tensor_file

def write_then_hang(path, tensors, *how):
    written = write_file(path, tensors, *how)
    if Path(path).parent.name == ".step-00000004.partial":
        Path(signal_path).write_text("one file of the step-4 save is written")
        time.sleep(600)
    return written

writer.write_tensor_file = write_then_hang
Trainer(load_run_config(config_path)).fit()
"""


def test_sigkill_in_the_middle_of_a_save_leaves_the_previous_checkpoint_and_resume_uses_it(make_config, tmp_path):
    """(d)"""
    run_dir = tmp_path / "run"
    config = make_config("train.steps=6", "checkpoint.interval=2", run_dir=run_dir)
    config_path = tmp_path / "killed.yaml"
    config_path.write_text(dump_yaml(config))
    signal_path = tmp_path / "mid-save"
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_MID_SAVE, str(config_path), str(signal_path)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not signal_path.exists():
            assert child.poll() is None, child.stderr.read().decode()
            assert time.monotonic() < deadline, "the child never reached the step-4 save"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    checkpoints = run_dir / "checkpoints"
    assert [p.name for p in list_checkpoints(checkpoints)] == ["step-00000002"]
    assert (checkpoints / ".step-00000004.partial").is_dir()
    verify_checkpoint(checkpoints / "step-00000002")

    Trainer(make_config("train.steps=6", "checkpoint.interval=2", "resume=latest", run_dir=run_dir)).fit()
    record = json.loads((run_dir / "run.json").read_text())
    assert record["resumed_from"]["step"] == 2 and record["status"] == "completed"
    assert [p.name for p in list_checkpoints(checkpoints)] == ["step-00000002", "step-00000004", "step-00000006"]
    assert not (checkpoints / ".step-00000004.partial").exists()
    assert [r["step"] for r in _metrics(run_dir)] == list(range(1, 7))


def test_resuming_into_another_model_names_the_differing_fields(make_config, tmp_path):
    run_dir = tmp_path / "run"
    Trainer(make_config("train.steps=1", run_dir=run_dir)).fit()
    before = (run_dir / "metrics.jsonl").read_text()
    other = make_config("train.steps=2", "model.moe.num_experts=8", "model.dim=64", "resume=latest", run_dir=run_dir)
    with pytest.raises(ConfigError) as error:
        Trainer(other).fit()
    assert "model.dim: checkpoint 32, this run 64" in str(error.value)
    assert "model.moe.num_experts: checkpoint 4, this run 8" in str(error.value)
    assert (run_dir / "metrics.jsonl").read_text() == before


def test_a_checkpoint_from_before_a_model_field_existed_resumes_with_its_default(make_config, tmp_path):
    """`model.qk_norm_scope` came after checkpoints were written without it; its default is what they computed."""
    from types import SimpleNamespace

    from ferry.train.checkpointing import check_config

    config = make_config("model.qk_norm=true")
    saved = config.model_dump(mode="json")
    del saved["model"]["qk_norm_scope"]
    old = SimpleNamespace(path=tmp_path, manifest=SimpleNamespace(model=saved["model"], run_config=saved))
    assert check_config(old, config) == []
    with pytest.raises(ConfigError, match="model.qk_norm_scope: checkpoint 'projection', this run 'head'"):
        check_config(old, make_config("model.qk_norm=true", "model.qk_norm_scope=head"))


def test_how_a_model_is_trained_may_change_what_it_computes_may_not(make_config, tmp_path):
    """The routers' loss weights, the bias balancing's step and the initial draw's scale are notes, as is the
    width of dense layers when neither side has one; the width of a dense layer that exists is refused."""
    from types import SimpleNamespace

    from ferry.train.checkpointing import check_config

    saved = make_config("model.dense_layers=0").model_dump(mode="json")
    old = SimpleNamespace(path=tmp_path, manifest=SimpleNamespace(model=saved["model"], run_config=saved))
    training = (
        "model.moe.z_loss_coef=0.01",
        "model.moe.aux_loss_coef=0.1",
        "model.init_std=0.01",
        "model.moe.bias_balancing.update_rate=0.01",
    )
    notes = check_config(old, make_config("model.dense_layers=0", "model.dense_ffn_dim=48", *training))
    assert sorted(note.split(":")[0] for note in notes) == sorted(item.split("=")[0] for item in training)
    dense = make_config("model.dense_layers=1").model_dump(mode="json")
    old = SimpleNamespace(path=tmp_path, manifest=SimpleNamespace(model=dense["model"], run_config=dense))
    with pytest.raises(ConfigError, match="model.dense_ffn_dim: checkpoint 64, this run 48"):
        check_config(old, make_config("model.dense_layers=1", "model.dense_ffn_dim=48"))


def test_other_config_changes_are_reported_on_resume(make_config, tmp_path, capsys):
    run_dir = tmp_path / "run"
    Trainer(make_config("train.steps=2", run_dir=run_dir)).fit(stop_at=1)
    Trainer(make_config("train.steps=2", "optim.lr=0.001", "resume=latest", run_dir=run_dir)).fit()
    assert "config differs from the checkpoint's: optim.lr: checkpoint 0.003, this run 0.001" in capsys.readouterr().out


def test_resume_latest_without_a_checkpoint_starts_fresh_and_a_fresh_start_keeps_off_an_earlier_run(
    make_config, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    Trainer(make_config("train.steps=1", "resume=latest", run_dir=run_dir)).fit()
    assert "no checkpoint to resume from" in capsys.readouterr().out
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step-00000001"]
    (run_dir / "metrics.jsonl").unlink()
    (run_dir / "run.json").unlink()
    (run_dir / "config.yaml").unlink()
    with pytest.raises(UserError, match="checkpoints in"):
        Trainer(make_config("train.steps=1", run_dir=run_dir)).fit()
    Trainer(make_config("train.steps=2", "run.overwrite=true", run_dir=run_dir)).fit()
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step-00000002"]


def test_run_overwrite_replaces_its_own_checkpoint_dir_and_not_another_runs(make_config, tmp_path):
    shared = tmp_path / "elsewhere"
    first = make_config("train.steps=1", f"checkpoint.dir={shared}", run_dir=tmp_path / "first")
    Trainer(first).fit()
    assert [p.name for p in list_checkpoints(shared)] == ["step-00000001"]
    again = make_config("train.steps=2", f"checkpoint.dir={shared}", "run.overwrite=true", run_dir=tmp_path / "first")
    Trainer(again).fit()
    assert [p.name for p in list_checkpoints(shared)] == ["step-00000002"], "its own earlier run's are replaced"
    other = make_config("train.steps=1", f"checkpoint.dir={shared}", "run.overwrite=true", run_dir=tmp_path / "other")
    with pytest.raises(UserError, match="holds the checkpoints of a run other than the one in run.dir"):
        Trainer(other).fit()
    assert [p.name for p in list_checkpoints(shared)] == ["step-00000002"]


def test_init_from_a_missing_path_names_init_from(make_config, tmp_path):
    with pytest.raises(UserError, match=f"init_from: '{tmp_path / 'nothing'}' does not exist"):
        Trainer(make_config("train.steps=1", f"init_from={tmp_path / 'nothing'}")).fit()


def test_a_resume_onto_data_of_another_tokenizer_is_refused(make_config, stdlib_dataset, tmp_path):
    """The same vocabulary size, other ids for the same text: the run would go on training on noise."""
    from ferry.data import PrepareSpec, prepare_dataset

    run_dir = tmp_path / "run"
    Trainer(make_config("train.steps=2", run_dir=run_dir)).fit(stop_at=1)
    text = tmp_path / "text.txt"
    text.write_text("def other(corpus):\n    return corpus * 2\n" * 400)
    other = prepare_dataset(PrepareSpec(inputs=[str(text)], vocab_size=512), tmp_path / "other").output
    resumed = make_config("train.steps=2", "resume=latest", f"data.sources.0.path={other}", run_dir=run_dir)
    with pytest.raises(UserError, match="was trained on text tokenized otherwise than this run's data"):
        Trainer(resumed).fit()


def test_run_overwrite_keeps_an_earlier_run_that_went_further_than_the_new_one_will(make_config, tmp_path, capsys):
    """A short run in the directory of a longer one (a config that sets run.overwrite, run again with
    train.steps=3) keeps the longer run whole in replaced/, says where, and replaces a run no further than it."""
    run_dir = tmp_path / "run"
    Trainer(make_config("train.steps=4", "checkpoint.interval=2", run_dir=run_dir)).fit()
    earlier_metrics = (run_dir / "metrics.jsonl").read_text()
    capsys.readouterr()
    Trainer(make_config("train.steps=2", "run.overwrite=true", run_dir=run_dir)).fit()
    (kept,) = (run_dir / "replaced").iterdir()
    assert kept.name.endswith("-reached-step-00000004")
    assert [p.name for p in list_checkpoints(kept / "checkpoints")] == ["step-00000002", "step-00000004"]
    assert (kept / "metrics.jsonl").read_text() == earlier_metrics and (kept / "run.json").exists()
    assert verify_checkpoint(kept / "checkpoints" / "step-00000004").step == 4  # whole: it verifies
    out = capsys.readouterr().out
    assert f"reached step 4, past this run's last step (2), so it is kept, not deleted, in {kept}" in out
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step-00000002"]
    assert json.loads((run_dir / "run.json").read_text())["replaced_run"] == str(kept)
    Trainer(make_config("train.steps=2", "run.overwrite=true", run_dir=run_dir)).fit()
    assert [p.name for p in (run_dir / "replaced").iterdir()] == [kept.name], "a run no further is replaced"
    assert json.loads((run_dir / "run.json").read_text())["replaced_run"] is None


def test_run_overwrite_takes_the_earlier_runs_plots_with_its_records(make_config, tmp_path):
    """`ferry plot`'s PNGs (and TensorBoard's, the traces') are the earlier run's records: kept with them in
    replaced/, or deleted with them; never left beside the new run's metrics."""
    run_dir = tmp_path / "run"
    Trainer(make_config("train.steps=4", "checkpoint.interval=2", run_dir=run_dir)).fit()
    assert main(["plot", str(run_dir)]) == 0
    drawn = sorted(path.name for path in (run_dir / "plots").iterdir())
    Trainer(make_config("train.steps=2", "run.overwrite=true", run_dir=run_dir)).fit()
    (kept,) = (run_dir / "replaced").iterdir()
    assert sorted(path.name for path in (kept / "plots").iterdir()) == drawn and drawn
    assert not (run_dir / "plots").exists()
    assert main(["plot", str(run_dir)]) == 0
    Trainer(make_config("train.steps=2", "run.overwrite=true", run_dir=run_dir)).fit()
    assert not (run_dir / "plots").exists(), "a run no further is replaced, its plots with it"
