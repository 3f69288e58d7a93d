"""Pipelines: stages in order, each from its parent's checkpoint, recorded in a lineage that refuses a
changed parent; a stage killed mid-way resumes and ends exactly as an uninterrupted one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import TINY_RUN, tiny_config

from ferry.checkpoint import list_checkpoints, verify_checkpoint
from ferry.checkpoint.digests import checkpoint_digest
from ferry.cli.main import main
from ferry.config import UserError
from ferry.stages import run_pipeline
from ferry.train import Trainer


def _write_pipeline(tmp_path, dataset, midtrain_overrides: dict | None = None, pretrain_from: str | None = None):
    config = {**TINY_RUN, "data": {**TINY_RUN["data"], "sources": [{"name": "stdlib", "path": str(dataset)}]}}
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(config))
    pretrain = {
        "name": "pretrain",
        "config": "tiny.yaml",
        "overrides": {"train.steps": 4, "checkpoint.interval": 2, "optim.schedule": "wsd"},
    }
    if pretrain_from:
        pretrain["init_from"] = pretrain_from
    midtrain = {
        "name": "midtrain",
        "init_from": "previous",
        "carry": "weights+optimizer",
        "lr": "parent",
        "overrides": {
            "train.steps": 4,
            "optim.schedule": "linear",
            "optim.min_lr_ratio": 0.0,
            "optim.warmup_steps": 0,
            "run.seed": 1,
            **(midtrain_overrides or {}),
        },
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump({"name": "test", "stages": [pretrain, midtrain]}, sort_keys=False))
    return path


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished(stdlib_dataset, tmp_path_factory):
    """The two-stage pipeline run once, uninterrupted: its file and its directory (tests only read them)."""
    root = tmp_path_factory.mktemp("pipeline")
    path = _write_pipeline(root, stdlib_dataset)
    run_pipeline(path, root / "out")
    return path, root / "out"


def test_stages_run_from_their_parents_and_the_lineage_records_it(finished, capsys):
    path, out_dir = finished
    lineage = run_pipeline(path, out_dir)
    pretrain, midtrain = lineage.stages["pretrain"], lineage.stages["midtrain"]
    assert pretrain["status"] == midtrain["status"] == "finished"
    parent_checkpoint = out_dir / "pretrain" / "checkpoints" / "step-00000004"
    assert midtrain["parent"]["checkpoint"] == str(parent_checkpoint)
    assert midtrain["parent"]["digest"] == checkpoint_digest(parent_checkpoint) == pretrain["result"]["digest"]
    assert midtrain["data"][0]["manifest_sha256"] and midtrain["seed"] == 1 and midtrain["code"]["ferry"]
    realised = json.loads((out_dir / "midtrain" / "run.json").read_text())["data_realised"]
    assert midtrain["result"]["data_realised"] == realised and realised[0]["windows"] > 0
    midtrain_records = _records(out_dir / "midtrain")
    assert [r["step"] for r in midtrain_records] == [1, 2, 3, 4], "the step counter starts again"
    assert midtrain_records[0]["lr"] == pytest.approx(_records(out_dir / "pretrain")[-1]["lr"])
    assert midtrain_records[-1]["lr"] == 0.0, "linear decay to zero"
    stored = verify_checkpoint(parent_checkpoint)
    run = json.loads((out_dir / "midtrain" / "run.json").read_text())
    assert run["config"]["init_optimizer"] is True and run["config"]["init_from"] == str(parent_checkpoint)
    assert stored.step == 4
    capsys.readouterr()
    run_pipeline(path, out_dir)
    out = capsys.readouterr().out
    assert "stage pretrain: finished earlier" in out and "stage midtrain: finished earlier" in out
    assert main(["pipeline", "show", str(out_dir)]) == 0
    shown = capsys.readouterr().out
    assert "pretrain @ step 4" in shown and "weights+optimizer, lr from parent" in shown


def test_a_changed_parent_is_refused_until_rerun(stdlib_dataset, tmp_path, capsys):
    external = tmp_path / "external"
    Trainer(tiny_config(stdlib_dataset, external, "train.steps=2")).fit()
    path = _write_pipeline(tmp_path, stdlib_dataset, pretrain_from=str(external))
    run_pipeline(path, tmp_path / "out")
    Trainer(tiny_config(stdlib_dataset, external, "train.steps=4", "resume=latest")).fit()
    with pytest.raises(UserError, match=r"stage pretrain: its parent changed since it ran .*--rerun pretrain"):
        run_pipeline(path, tmp_path / "out")
    lineage = run_pipeline(path, tmp_path / "out", rerun="pretrain")
    assert lineage.stages["pretrain"]["parent"]["step"] == 4
    assert lineage.stages["midtrain"]["parent"]["digest"] == lineage.stages["pretrain"]["result"]["digest"]


def test_a_rerun_whose_stage_refuses_its_input_puts_every_stage_back(finished, stdlib_dataset, tmp_path, capsys):
    path, original = finished
    out = Path(shutil.copytree(original, tmp_path / "out"))
    cache = out / "midtrain" / "reference-cache"
    cache.mkdir()
    (cache / "entry").write_text("kept")
    before = (out / "lineage.json").read_text()
    typo = {"data.sources": [{"name": "stdlib", "path": str(tmp_path / "no-such-data")}]}
    broken = _write_pipeline(tmp_path, stdlib_dataset, midtrain_overrides=typo)
    with pytest.raises(UserError, match=r"stage midtrain refused its input .* set aside for --rerun midtrain are back"):
        run_pipeline(broken, out, rerun="midtrain")
    assert (out / "lineage.json").read_text() == before  # the same records, in the file's order
    assert list_checkpoints(out / "midtrain" / "checkpoints") and (cache / "entry").read_text() == "kept"
    assert not (out / ".replaced").exists()
    lineage = run_pipeline(path, out, rerun="midtrain")
    assert [stage["name"] for stage in json.loads((out / "lineage.json").read_text())["stages"]] == [
        "pretrain",
        "midtrain",
    ]
    assert lineage.stages["midtrain"]["status"] == "finished" and (cache / "entry").read_text() == "kept"
    assert not (out / ".replaced").exists()


def test_a_finished_stage_whose_config_changed_is_refused(finished, stdlib_dataset, tmp_path):
    _, out = finished
    path = _write_pipeline(tmp_path, stdlib_dataset, midtrain_overrides={"optim.weight_decay": 0.0})
    with pytest.raises(UserError, match=r"stage midtrain finished with another config .*optim.weight_decay"):
        run_pipeline(path, out)


def test_a_finished_stage_whose_seed_or_start_changed_is_refused(finished, stdlib_dataset, tmp_path):
    path, out = finished
    before = (out / "lineage.json").read_text()
    with pytest.raises(UserError, match=r"stage pretrain finished with another config .*run.seed"):
        run_pipeline(path, out, overrides=["run.seed=7"])
    spec = yaml.safe_load(path.read_text())
    spec["stages"][1]["carry"] = "weights"
    (tmp_path / "carry.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    (tmp_path / "tiny.yaml").write_text((path.parent / "tiny.yaml").read_text())
    changed = r"stage midtrain finished .*carry: it ran with weights\+optimizer, this run weights"
    with pytest.raises(UserError, match=changed):
        run_pipeline(tmp_path / "carry.yaml", out)
    assert (out / "lineage.json").read_text() == before


@pytest.mark.parametrize("override", ["init_from=/some/checkpoint", "resume=latest", "run.dir=/elsewhere"])
def test_a_key_the_pipeline_sets_per_stage_is_refused_on_the_command_line(finished, override):
    path, out = finished
    with pytest.raises(UserError, match=rf"{override.split('=')[0]}: the pipeline sets it for each stage"):
        run_pipeline(path, out, overrides=[override])


def test_a_stage_killed_midway_resumes_to_the_uninterrupted_result(finished, stdlib_dataset, tmp_path):
    straight = run_pipeline(*finished)  # finished earlier: its lineage as recorded
    killed = _write_pipeline(
        tmp_path, stdlib_dataset, {"checkpoint.interval": 2, "fault.inject": [{"step": 4, "kind": "kill"}]}
    )
    lineage = run_pipeline(killed, tmp_path / "resumed")
    assert lineage.stages["midtrain"]["status"] == "failed"
    lineage = run_pipeline(_write_pipeline(tmp_path, stdlib_dataset, {"checkpoint.interval": 2}), tmp_path / "resumed")
    assert lineage.stages["midtrain"]["status"] == "finished" and lineage.stages["midtrain"]["attempts"] == 2
    ours = verify_checkpoint(lineage.stages["midtrain"]["result"]["checkpoint"])
    theirs = verify_checkpoint(straight.stages["midtrain"]["result"]["checkpoint"])
    for name in theirs.names("model."):
        assert torch.equal(ours.read(name), theirs.read(name)), name


@pytest.mark.parametrize(
    "stages, named",
    [
        ([{"name": "a", "config": "tiny.yaml"}, {"name": "a", "init_from": "previous"}], "stage names must be unique"),
        ([{"name": "a", "config": "tiny.yaml", "init_from": "previous"}], "no previous stage"),
        (
            [{"name": "a", "config": "tiny.yaml"}, {"name": "b", "init_from": "previous", "steps": "continue"}],
            "carry: weights+optimizer",
        ),
        ([{"name": "a", "config": "tiny.yaml", "overrides": {"optim.schedule": "step"}}], "stage a of"),
        ([{"name": "a", "config": "missing.yaml"}], "missing.yaml"),
    ],
)
def test_bad_pipeline_files_exit_2_naming_the_problem(stdlib_dataset, tmp_path, stages, named, capsys):
    _write_pipeline(tmp_path, stdlib_dataset)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"name": "bad", "stages": stages}))
    assert main(["pipeline", "run", str(path), "--dir", str(tmp_path / "out")]) == 2
    assert named in capsys.readouterr().err


def test_a_stage_that_refuses_its_input_is_recorded_as_refused(stdlib_dataset, tmp_path, capsys):
    path = _write_pipeline(tmp_path, stdlib_dataset, midtrain_overrides={"data.sources.0.path": str(tmp_path / "gone")})
    assert main(["pipeline", "run", str(path), "--dir", str(tmp_path / "out")]) == 2
    assert "stage midtrain refused its input (exit 2" in capsys.readouterr().err
    stages = {stage["name"]: stage for stage in json.loads((tmp_path / "out" / "lineage.json").read_text())["stages"]}
    assert stages["pretrain"]["status"] == "finished"
    assert stages["midtrain"]["status"] == "refused" and stages["midtrain"]["returncode"] == 2


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda lineage: lineage["stages"][0].pop("status"), "stages.0.status: Field required"),
        (lambda lineage: lineage["stages"][1]["result"].update(step="four"), "stages.1.result.step"),
        (lambda lineage: lineage.update(stages={}), "stages: Input should be a valid list"),
        (lambda lineage: lineage["stages"][0].update(result=None), "a finished stage has no result"),
    ],
)
def test_a_lineage_of_the_wrong_shape_is_refused_naming_the_field(finished, tmp_path, edit, named, capsys):
    path, out_dir = finished
    lineage = json.loads((out_dir / "lineage.json").read_text())
    edit(lineage)
    (tmp_path / "lineage.json").write_text(json.dumps(lineage))
    assert main(["pipeline", "show", str(tmp_path)]) == 2
    assert named in capsys.readouterr().err
    assert main(["pipeline", "run", str(path), "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'lineage.json'} is not a lineage as ferry writes it" in err and named in err
    assert json.loads((tmp_path / "lineage.json").read_text()) == lineage  # refused, not rewritten
