"""Releases: a finished pipeline packaged whole, verified file by file and along its chain, replayed from the
release alone and judged under the rehearsal's profiles, and branched from."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import TINY_RUN

from ferry.checkpoint import list_checkpoints
from ferry.cli.main import main
from ferry.data.manifest import sha256_file
from ferry.portability.release.build import build_release
from ferry.stages import run_pipeline
from ferry.train import Trainer, load_run_config, train

PRETRAIN_STEPS = 40  # long enough for a 20% learning-rate change to leave the cross-accelerator band (step ~22)


def _write_pipeline(root: Path, dataset: Path, stages: list[dict] | None = None) -> Path:
    config = {**TINY_RUN, "data": {**TINY_RUN["data"], "sources": [{"name": "stdlib", "path": str(dataset)}]}}
    config["model"] = {**config["model"], "qk_norm": True, "qk_norm_scope": "head"}  # as qwen3_moe: exported
    config["metrics"] = {"sinks": {"console": False}}
    (root / "tiny.yaml").write_text(yaml.safe_dump(config))
    pretrain = {
        "name": "pretrain",
        "config": "tiny.yaml",
        "overrides": {
            "train.steps": PRETRAIN_STEPS,
            "checkpoint.interval": 20,
            "optim.schedule": "wsd",
            "eval.sources": [{"name": "held_out", "path": str(dataset)}],
            "eval.interval": 0,
        },
    }
    midtrain = {
        "name": "midtrain",
        "init_from": "previous",
        "carry": "weights+optimizer",
        "lr": "parent",
        "overrides": {
            "train.steps": 4,
            "checkpoint.interval": 4,
            "optim.schedule": "linear",
            "optim.warmup_steps": 0,
            "run.seed": 1,
        },
    }
    path = root / "pipeline.yaml"
    spec = {"name": "test" if stages is None else "branch", "stages": stages or [pretrain, midtrain]}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def released(stdlib_dataset, tmp_path_factory):
    """The two-stage pipeline (on its own copy of the data) run once and released twice: with AdamW state, and
    weights only with the data files (tests copy them before changing anything)."""
    root = tmp_path_factory.mktemp("release")
    dataset = Path(shutil.copytree(stdlib_dataset, root / "stdlib"))
    manifest = json.loads((dataset / "manifest.json").read_text())
    (dataset / "manifest.json").write_text(json.dumps({**manifest, "licence": "PSF-2.0"}))  # as a corpus may say
    run_pipeline(_write_pipeline(root, dataset), root / "pipeline", say=lambda line: None)
    (root / "pipeline" / "cost.json").write_text("{}")  # a cost record beside the stages
    assert main(["release", str(root / "pipeline"), "--out", str(root / "full"), "--optimizer"]) == 0
    build_release(root / "pipeline", root / "weights", data=True, say=lambda line: None)
    return root


def _copy(released: Path, tmp_path: Path, name: str = "full") -> Path:
    return Path(shutil.copytree(released / name, tmp_path / name))


def test_a_release_holds_every_stage_and_verifies(released, capsys):
    full = released / "full"
    content = json.loads((full / "release.json").read_text())
    assert [stage["name"] for stage in content["stages"]] == ["pretrain", "midtrain"]
    for stage in content["stages"]:
        for file in ("config.yaml", "run.json", "metrics.jsonl", "tokenizer.json"):
            assert f"stages/{stage['name']}/{file}" in content["files"]
        checkpoint = stage["checkpoint"]
        assert checkpoint["optimizer"] and checkpoint["digest"] == checkpoint["lineage_digest"]
        assert stage["export"]["arch"] == "qwen3_moe", stage["export"]
        assert f"stages/{stage['name']}/transformers/config.json" in content["files"]
    midtrain = content["stages"][1]
    assert midtrain["parent"]["digest"] == content["stages"][0]["checkpoint"]["lineage_digest"]
    assert content["data"][0]["manifest_sha256"] and content["data"][0]["tokens"] > 0
    assert content["code"]["ferry"] and {"lineage.json", "data/stdlib/manifest.json"} <= set(content["files"])
    assert content["data"][0]["licence"] == "PSF-2.0" and content["extras"] == ["extras/cost.json"]
    assert all(sha256_file(full / name) == record["sha256"] for name, record in content["files"].items())
    card = (full / "README.md").read_text()
    assert "| pretrain | lm | scratch | 40 |" in card and "| PSF-2.0 |" in card
    assert "ferry release replay . --stage pretrain" in card
    assert "ferry release branch . --stage midtrain\n" in card and "weights and AdamW state." in card
    card = (released / "weights" / "README.md").read_text()
    assert "ferry release branch . --stage midtrain\n" in card and "(this release carries no optimizer state)" in card
    assert "with the release's own copy of its data" in card
    assert main(["release", "verify", str(full)]) == 0
    assert "PASS" in capsys.readouterr().out
    weights = json.loads((released / "weights" / "release.json").read_text())
    assert not any("optim-" in name for name in weights["files"])
    assert "data/stdlib/shard-00000.npy" in weights["files"] and weights["data"][0]["files_included"]
    assert "stages/pretrain/source-manifest.json" in weights["files"]
    assert main(["release", "verify", str(released / "weights")]) == 0


@pytest.mark.parametrize(
    "file",
    [
        "stages/pretrain/checkpoints/step-00000040/model-rank00000-part0000.safetensors",
        "stages/midtrain/metrics.jsonl",
        "README.md",
        "data/stdlib/manifest.json",
    ],
)
def test_a_flipped_byte_fails_naming_the_file(released, tmp_path, file, capsys):
    release = _copy(released, tmp_path)
    data = bytearray((release / file).read_bytes())
    data[len(data) // 2] ^= 0x01
    (release / file).write_bytes(bytes(data))
    assert main(["release", "verify", str(release)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and f"{file}: sha256 differs" in out


def test_a_chain_that_does_not_hold_fails_even_with_the_digests_rewritten(released, tmp_path, capsys):
    release = _copy(released, tmp_path, "weights")
    lineage = json.loads((release / "lineage.json").read_text())
    lineage["stages"][1]["parent"]["digest"] = "0" * 64
    (release / "lineage.json").write_text(json.dumps(lineage))
    (release / "extra.txt").write_text("slipped in")
    content = json.loads((release / "release.json").read_text())
    content["files"]["lineage.json"] = {
        "bytes": (release / "lineage.json").stat().st_size,
        "sha256": sha256_file(release / "lineage.json"),
    }
    (release / "release.json").write_text(json.dumps(content))
    assert main(["release", "verify", str(release)]) == 1
    out = capsys.readouterr().out
    assert "stage midtrain's parent digest 000000000000 is not stage pretrain's final checkpoint" in out
    assert "extra.txt: not listed in release.json" in out


def test_what_is_no_release_exits_2(released, tmp_path, capsys):
    assert main(["release", "verify", str(tmp_path)]) == 2
    assert "is not a ferry release: release.json is missing" in capsys.readouterr().err
    assert main(["release", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "holds no pipeline" in capsys.readouterr().err
    assert main(["release", str(released / "pipeline"), "--out", str(released / "full")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err


def test_a_replay_of_a_token_stage_passes_and_one_with_lr_x1_2_fails_naming_the_profile(released, tmp_path, capsys):
    weights = released / "weights"  # it holds the data files: with the pipeline's data moved away, it is the source
    dataset = released / "stdlib"
    aside = Path(shutil.move(dataset, tmp_path / "aside"))
    try:
        assert (
            main(
                [
                    "release",
                    "replay",
                    str(weights),
                    "--stage",
                    "pretrain",
                    "--steps",
                    "30",
                    "--work",
                    str(tmp_path / "same"),
                ]
            )
            == 0
        )
    finally:
        shutil.move(aside, dataset)
    out = capsys.readouterr().out
    assert "PASS under profile same-hardware (the environments do not differ)" in out
    verdict = json.loads((tmp_path / "same" / "replay.json").read_text())
    assert verdict["passed"] and verdict["verdict"]["steps_compared"] == 30
    release = _copy(released, tmp_path)  # a copy elsewhere, which reads the data where the config names it
    lr = yaml.safe_load((release / "stages" / "pretrain" / "config.yaml").read_text())["optim"]["lr"]
    (tmp_path / "lr.yaml").write_text(yaml.safe_dump({"name": "lr-x1.2", "overrides": {"optim.lr": lr * 1.2}}))
    assert (
        main(
            [
                "release",
                "replay",
                str(release),
                "--stage",
                "pretrain",
                "--steps",
                "30",
                "--env",
                str(tmp_path / "lr.yaml"),
                "--work",
                str(tmp_path / "lr"),
            ]
        )
        == 1
    )
    out = capsys.readouterr().out
    assert "FAIL under profile cross-accelerator (the environments differ in optim.lr)" in out
    assert "FAIL (first outside tolerance at step" in out


def test_a_replay_refuses_data_that_is_not_the_recorded_data(released, tmp_path, capsys):
    dataset = released / "stdlib"
    aside = Path(shutil.move(dataset, tmp_path / "aside"))
    try:
        assert (
            main(
                [
                    "release",
                    "replay",
                    str(released / "full"),
                    "--stage",
                    "pretrain",
                    "--work",
                    str(tmp_path / "missing"),
                ]
            )
            == 2
        )
        assert "data source stdlib is not at" in capsys.readouterr().err
        shutil.copytree(aside, dataset)
        manifest = json.loads((dataset / "manifest.json").read_text())
        manifest["documents"] += 1
        (dataset / "manifest.json").write_text(json.dumps(manifest))
        assert (
            main(
                ["release", "replay", str(released / "full"), "--stage", "pretrain", "--work", str(tmp_path / "other")]
            )
            == 2
        )
        err = capsys.readouterr().err
        assert "data source stdlib at " in err and "is not the data the stage trained on" in err
    finally:
        shutil.rmtree(dataset, ignore_errors=True)
        shutil.move(aside, dataset)
    assert not (tmp_path / "other").exists()


def test_a_stage_from_its_parent_replays_from_the_release(released, tmp_path, capsys):
    assert (
        main(["release", "replay", str(released / "full"), "--stage", "midtrain", "--work", str(tmp_path / "mid")]) == 0
    )
    out = capsys.readouterr().out
    assert "replay of stage midtrain (4 steps" in out and "max |diff| 0 " in out
    assert (
        main(
            ["release", "replay", str(released / "weights"), "--stage", "midtrain", "--work", str(tmp_path / "weights")]
        )
        == 2
    )
    assert "release the pipeline with --optimizer to replay it" in capsys.readouterr().err


def test_a_replay_of_a_tampered_release_or_of_no_stage_is_refused(released, tmp_path, capsys):
    release = _copy(released, tmp_path)
    assert main(["release", "replay", str(release), "--stage", "sft", "--work", str(tmp_path / "w")]) == 2
    assert "--stage 'sft': the release's stages are pretrain, midtrain" in capsys.readouterr().err
    (release / "README.md").write_text("changed")
    assert main(["release", "replay", str(release), "--stage", "pretrain", "--work", str(tmp_path / "w")]) == 2
    assert "does not verify (README.md: " in capsys.readouterr().err


def test_training_continues_from_any_stage_of_a_release(released, tmp_path):
    stage = released / "weights" / "stages" / "midtrain"  # as the model card says: its config, its checkpoints
    config = load_run_config(
        str(stage / "config.yaml"),
        [
            f"init_from={stage / 'checkpoints'}",
            "init_optimizer=false",
            f"run.dir={tmp_path / 'branch'}",
            "train.steps=2",
        ],
    )
    Trainer(config).fit()
    run = json.loads((tmp_path / "branch" / "run.json").read_text())
    assert run["status"] == "completed" and list_checkpoints(tmp_path / "branch" / "checkpoints")
    assert main(["release", "verify", str(released / "weights")]) == 0  # branching wrote nothing into the release


def test_a_pipeline_branches_from_a_released_stage_with_its_lineage_pointing_into_the_release(
    released, tmp_path, capsys
):
    checkpoints = released / "weights" / "stages" / "midtrain" / "checkpoints"
    branch = {
        "name": "sft",
        "config": "tiny.yaml",
        "init_from": str(checkpoints),
        "overrides": {"train.steps": 2, "checkpoint.interval": 2},
    }
    path = _write_pipeline(tmp_path, released / "stdlib", stages=[branch])
    lineage = run_pipeline(path, tmp_path / "branch", say=lambda line: None)
    parent = lineage.stages["sft"]["parent"]
    released_checkpoint = json.loads((released / "weights" / "release.json").read_text())["stages"][1]["checkpoint"]
    assert lineage.stages["sft"]["status"] == "finished"
    assert parent["checkpoint"] == str(checkpoints / "step-00000004")
    assert parent["digest"] == released_checkpoint["digest"]
    assert main(["release", "verify", str(released / "weights")]) == 0


@pytest.fixture(scope="module")
def grpo_release(stdlib_dataset, tmp_path_factory):
    """A two-stage chain that ends in GRPO (SFT on the largest-digit task's chat, then GRPO on its prompts),
    released with its data. GRPO draws 512 completions a step (32 prompts x 16): with fewer, the spread between
    seeds hides a sampling temperature of 0.7 (ferry/portability/tolerances.yaml, `sampled`)."""
    from ferry.data import PrepareSpec, prepare_dataset

    root = tmp_path_factory.mktemp("grpo-release")
    tokenizer = str(stdlib_dataset / "tokenizer.json")
    prepare_dataset(
        PrepareSpec(embedded="largest", tokenizer=tokenizer, embedded_max_bytes=60_000, chat=True, seq_len=64),
        root / "chat",
    )
    prepare_dataset(
        PrepareSpec(embedded="largest", tokenizer=tokenizer, embedded_max_bytes=60_000, records="prompts"),
        root / "prompts",
    )
    config = {
        **TINY_RUN,
        "model": {**TINY_RUN["model"], "vocab_size": 576},
        "data": {"seq_len": 64, "sources": [{"name": "chat", "path": str(root / "chat")}]},
        "metrics": {"sinks": {"console": False}},
    }
    (root / "tiny.yaml").write_text(yaml.safe_dump(config))
    sft = {
        "name": "sft",
        "config": "tiny.yaml",
        "overrides": {"train.steps": 120, "optim.lr": 1e-2, "checkpoint.interval": 120},
    }
    grpo = {
        "name": "grpo",
        "init_from": "previous",
        "overrides": {
            "train.objective": "grpo",
            "data.sources": [{"name": "prompts", "path": str(root / "prompts")}],
            "train.global_batch": 32,
            "train.micro_batch": 16,
            "grpo.group_size": 16,
            "grpo.max_new_tokens": 3,
            "grpo.verifier": "numeric",
            "optim.lr": 1e-3,
            "train.steps": 6,
            "checkpoint.interval": 6,
        },
    }
    (root / "pipeline.yaml").write_text(yaml.safe_dump({"name": "rl", "stages": [sft, grpo]}, sort_keys=False))
    run_pipeline(root / "pipeline.yaml", root / "pipeline", say=lambda line: None)
    build_release(root / "pipeline", root / "release", data=True, say=lambda line: None)
    return root / "release"


def test_a_grpo_replay_trains_its_seed_runs_and_is_judged_by_sampled(grpo_release, tmp_path, capsys):
    assert main(["release", "verify", str(grpo_release)]) == 0
    assert main(["release", "replay", str(grpo_release), "--stage", "grpo", "--work", str(tmp_path / "w")]) == 0
    captured = capsys.readouterr()
    assert "the release carries no seed runs, so 2 are trained here" in captured.err
    assert "PASS under profile sampled (objective grpo draws its own training data" in captured.out
    summary = json.loads((tmp_path / "w" / "replay.json").read_text())
    assert len(summary["seed_runs"]) == 2 and summary["verdict"]["metric"] == "reward"
    assert summary["verdict"]["seed_spread"] > 0
    assert main(["release", "replay", str(grpo_release), "--stage", "grpo", "--work", str(tmp_path / "w")]) == 0
    assert capsys.readouterr().err.count("trained earlier with this config") == 2, "the seed runs are reused"


def test_a_release_carries_seed_runs_and_a_replay_at_temperature_0_7_fails_against_them(grpo_release, tmp_path, capsys):
    """`--seed-runs` trains the seed runs with the release, so a replay trains only itself. The recorded stage samples
    at temperature 1.0; rollouts at 0.7 score rewards that differ from the first step on by more than 4 seed spreads
    (measured: 0.055 against a band of 0.018 on AVX-512, 0.061 against 0.026 on AVX2)."""
    release = tmp_path / "release"
    assert main(["release", str(grpo_release.parent / "pipeline"), "--out", str(release), "--seed-runs"]) == 0
    assert "stage grpo: objective grpo samples its training data; training the seed runs" in capsys.readouterr().err
    carried = next(
        stage for stage in json.loads((release / "release.json").read_text())["stages"] if stage["name"] == "grpo"
    )["seed_runs"]
    assert carried == ["stages/grpo/seed-runs/seed-1", "stages/grpo/seed-runs/seed-2"]
    assert main(["release", "verify", str(release)]) == 0
    temperature = {"name": "temperature-0.7", "overrides": {"grpo.temperature": 0.7}}
    (tmp_path / "t07.yaml").write_text(yaml.safe_dump(temperature))
    code = main(
        [
            "release",
            "replay",
            str(release),
            "--stage",
            "grpo",
            "--env",
            str(tmp_path / "t07.yaml"),
            "--work",
            str(tmp_path / "w"),
        ]
    )
    captured = capsys.readouterr()
    assert code == 1
    assert "FAIL under profile sampled (objective grpo draws its own training data" in captured.out
    assert "judged against the 2 seed runs the release carries (seed-1, seed-2" in captured.err
    assert "trained here" not in captured.err and not (tmp_path / "w" / "seed-1").exists()


def _card_commands(release: Path) -> list[str]:
    """Every `ferry ...` line of the model card's shell blocks, as printed (the comment after it left out)."""
    card, commands, in_shell = (release / "README.md").read_text(), [], False
    for line in card.splitlines():
        if line.startswith("```"):
            in_shell = line == "```sh"
        elif in_shell and line.startswith("ferry "):
            commands.append(line.split("   #")[0].split("  #")[0].strip())
    return commands


def test_every_command_of_the_card_runs_as_printed_inside_the_release_and_outside_it(
    released, tmp_path, monkeypatch, capsys
):
    """From inside the release (the card's `.`) every command runs and writes nothing into it: a replay and a branch
    work beside it. From elsewhere the same commands with the release's path for `.` run too."""
    release = _copy(released, tmp_path / "given", "weights")  # weights only, with the data
    commands = _card_commands(release)
    kinds = {command.split()[1] for command in commands}
    assert {"release", "generate", "eval"} <= kinds, commands
    monkeypatch.chdir(release)
    for command in commands:
        assert main(shlex.split(command)[1:]) == 0, (command, capsys.readouterr().err[-2000:])
    capsys.readouterr()
    assert main(["release", "verify", "."]) == 0, capsys.readouterr().out
    beside = sorted(path.name for path in release.parent.iterdir())
    assert beside == ["weights", "weights-branches", "weights-replays"], beside
    assert sorted(path.name for path in (release.parent / "weights-branches").iterdir()) == [
        "test-midtrain",
        "test-pretrain",
    ]
    branched = yaml.safe_load((release.parent / "weights-branches" / "test-midtrain" / "config.yaml").read_text())
    assert branched["data"]["sources"][0]["path"] == str(release / "data" / "stdlib"), "the release's own data"
    assert branched["init_from"] == str(release / "stages" / "midtrain" / "checkpoints" / "step-00000004")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for command in commands:
        if command.split()[1] == "release" and " . " in f"{command} ":
            outside = shlex.split(command.replace(" . ", f" {release} ").replace(" .", f" {release}"))[1:]
            if outside[0] == "branch":
                outside += ["train.steps=1"]
            assert main(outside) == 0, (outside, capsys.readouterr().err[-2000:])
    assert main(["release", "verify", str(release)]) == 0
    assert (elsewhere / "runs" / "release-replay" / "test-pretrain" / "replay.json").is_file()
    assert (elsewhere / "runs" / "release-branch" / "test-pretrain" / "run.json").is_file()


def test_a_replay_or_branch_asked_to_write_inside_the_release_is_refused(released, capsys):
    full = released / "full"
    assert main(["release", "replay", str(full), "--stage", "pretrain", "--work", str(full / "work")]) == 2
    assert "--work " in capsys.readouterr().err
    assert main(["release", "branch", str(full), "--stage", "pretrain", "--out", str(full / "branch")]) == 2
    assert "lies inside the release" in capsys.readouterr().err
    assert not (full / "work").exists() and not (full / "branch").exists()


def test_a_replay_on_a_pipeline_evaluates_its_held_out_data_and_passes(released, tmp_path, capsys):
    code = main(
        [
            "release",
            "replay",
            str(released / "full"),
            "--stage",
            "pretrain",
            "--steps",
            "6",
            "--env",
            "cpu-pp2",
            "--work",
            str(tmp_path / "pp2"),
            "eval.interval=3",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    assert "PASS under profile same-hardware (only layout, kernels or collectives differ: parallel.pp" in captured.out
    replay = tmp_path / "pp2" / "replay"
    sources = yaml.safe_load((replay / "config.yaml").read_text())["eval"]["sources"]
    assert [source["name"] for source in sources] == ["held_out"]
    records = [json.loads(line) for line in (replay / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records if "held_out" in record.get("eval.loss", {})] == [3, 6]


def test_an_environments_settings_are_honoured_or_refused_never_ignored(released, tmp_path, capsys):
    (tmp_path / "no-eval.yaml").write_text(yaml.safe_dump({"name": "no-eval", "overrides": {"eval.sources": []}}))
    assert (
        main(
            [
                "release",
                "replay",
                str(released / "full"),
                "--stage",
                "pretrain",
                "--steps",
                "2",
                "--env",
                str(tmp_path / "no-eval.yaml"),
                "--work",
                str(tmp_path / "no-eval"),
            ]
        )
        == 0
    )
    assert yaml.safe_load((tmp_path / "no-eval" / "replay" / "config.yaml").read_text())["eval"]["sources"] == []
    (tmp_path / "dir.yaml").write_text(yaml.safe_dump({"name": "dir", "overrides": {"run.dir": "elsewhere"}}))
    assert (
        main(
            [
                "release",
                "replay",
                str(released / "full"),
                "--stage",
                "pretrain",
                "--env",
                str(tmp_path / "dir.yaml"),
                "--work",
                str(tmp_path / "dir"),
            ]
        )
        == 2
    )
    assert "it sets run.dir, which the replay sets itself (run.dir)" in capsys.readouterr().err
    assert main(
        [
            "release",
            "replay",
            str(released / "full"),
            "--stage",
            "pretrain",
            "--steps",
            "2",
            "--work",
            str(tmp_path / "lr"),
            "optim.lr=0.004",
        ]
    ) in (0, 1)
    assert "the command line's overrides): " in capsys.readouterr().out
    assert yaml.safe_load((tmp_path / "lr" / "replay" / "config.yaml").read_text())["optim"]["lr"] == 0.004


def test_one_run_releases_as_a_one_stage_release(make_config, tmp_path, capsys):
    run = tmp_path / "run"
    train(make_config("train.steps=4", run_dir=run))
    release = tmp_path / "release"
    assert main(["release", str(run), "--out", str(release), "--optimizer", "--data"]) == 0
    content = json.loads((release / "release.json").read_text())
    assert [stage["name"] for stage in content["stages"]] == ["test"] and content["pipeline"]["kind"] == "run"
    assert "pipeline.yaml" not in content["files"] and content["extras"] == []
    assert (release / "README.md").read_text().startswith("# test: a ferry run release")
    assert main(["release", "verify", str(release)]) == 0
    capsys.readouterr()
    assert main(["release", "replay", str(release), "--stage", "test", "--work", str(tmp_path / "replay")]) == 0
    assert "max |diff| 0 " in capsys.readouterr().out
    stopped = tmp_path / "stopped"
    train(make_config("train.steps=4", "train.stop_at=2", run_dir=stopped))
    assert main(["release", str(stopped), "--out", str(tmp_path / "no")]) == 2
    assert f"run {stopped} has not completed" in capsys.readouterr().err and not (tmp_path / "no").exists()
