"""Environments as data: the shipped files, how they lay over a run config, the tolerance profile a move
gets, another accelerator's numerics on a CPU, and bad environment input (exit 2, nothing recorded)."""

from __future__ import annotations

import pytest
import yaml
from conftest import REPO, TINY_RUN

from ferry.cli.main import main
from ferry.platform.hardware import load_profile
from ferry.portability.comparison.environment import judging_profile, known_environments, load_environment
from ferry.precision import PrecisionConfig, resolve_precision

SHIPPED = ["cpu", "cpu-bf16-portable", "cpu-ep2", "cpu-pp2", "cuda", "h100-numerics", "mi300x-numerics"]


def _base(stdlib_dataset) -> dict:
    raw = yaml.safe_load(yaml.safe_dump(TINY_RUN))
    raw["data"]["sources"] = [{"name": "stdlib", "path": str(stdlib_dataset)}]
    return raw


def test_the_shipped_environments_load_by_name_and_lay_over_a_config(stdlib_dataset):
    assert set(SHIPPED) <= set(known_environments())
    for name in SHIPPED:
        environment = load_environment(name)
        assert environment.name == name and environment.description
        environment.run_config(_base(stdlib_dataset))
    ep2 = load_environment("cpu-ep2")
    config = ep2.run_config(_base(stdlib_dataset))
    assert ep2.nproc == 2 and config.parallel.ep == 2 and config.optim.zero
    portable = load_environment("cpu-bf16-portable").run_config(_base(stdlib_dataset))
    assert portable.kernels.policy == "portable" and portable.precision.compute_dtype == "bf16"
    assert load_environment("cuda").run_config(_base(stdlib_dataset)).run.device == "cuda"


def test_an_environment_is_found_by_path_too_and_its_digest_follows_its_definition(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("nproc: 1\noverrides:\n  optim.lr: 1.0e-3\n")
    mine = load_environment(str(path))
    assert mine.name == "mine" and mine.overrides == {"optim.lr": 1e-3}
    path.write_text("nproc: 1\noverrides:\n  optim.lr: 2.0e-3\n")
    assert load_environment(str(path)).digest != mine.digest


@pytest.mark.parametrize(
    "source, target, profile, named",
    [
        ("cpu-ep2", "cpu", "same-hardware", "parallel.ep"),
        ("cpu-pp2", "cpu", "same-hardware", "parallel.pp"),
        ("cpu", "cpu-bf16-portable", "cross-accelerator", "precision.compute_dtype"),
        ("h100-numerics", "mi300x-numerics", "cross-accelerator", "precision.profile"),
        ("cpu", "cpu", "same-hardware", "do not differ"),
    ],
)
def test_the_judging_profile_follows_what_the_move_changes(source, target, profile, named, stdlib_dataset):
    a, b = load_environment(source), load_environment(target)
    chosen, reason = judging_profile(
        a.run_config(_base(stdlib_dataset)), a.nproc, b.run_config(_base(stdlib_dataset)), b.nproc
    )
    assert chosen == profile and named in reason


def test_numerics_environments_rehearse_each_vendors_fp8_on_a_cpu(stdlib_dataset):
    cpu = load_profile("cpu")
    for name, fp8 in (("h100-numerics", "float8_e4m3fn"), ("mi300x-numerics", "float8_e4m3fnuz")):
        config = load_environment(name).run_config(_base(stdlib_dataset))
        policy = resolve_precision(config.precision, cpu)
        assert str(policy.recipe.forward_format.dtype) == f"torch.{fp8}"
        assert policy.experts_mode == "emulated" and policy.compute_dtype == "bf16"
        assert any(config.precision.profile in decision for decision in policy.decisions)


def test_precision_profile_names_a_known_profile():
    with pytest.raises(Exception, match="unknown hardware profile 'h1000'"):
        PrecisionConfig(profile="h1000")


def _env(tmp_path, text: str) -> str:
    path = tmp_path / "env.yaml"
    path.write_text(text)
    return str(path)


BAD = {
    "unknown name": (lambda t: "nowhere", "'nowhere' is neither a file nor a known environment"),
    "unknown top-level key": (lambda t: _env(t, "name: x\nnprocs: 2\n"), "nprocs"),
    "unknown config key": (lambda t: _env(t, "overrides:\n  parallel.epp: 2\n"), "parallel.epp"),
    "wrong value": (lambda t: _env(t, "overrides:\n  parallel.mode: tensor\n"), "parallel.mode"),
    "zero ranks": (lambda t: _env(t, "nproc: 0\n"), "nproc"),
    "not a mapping": (lambda t: _env(t, "- cpu\n"), "must hold a mapping"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_environment_input_exits_2_naming_it_and_records_nothing(case, tmp_path, capsys):
    make, culprit = BAD[case]
    spec = make(tmp_path)
    code = main(
        [
            "rehearse",
            str(REPO / "configs" / "tiny.yaml"),
            "--from",
            "cpu",
            "--to",
            spec,
            "--steps",
            "4",
            "--dir",
            str(tmp_path / "work"),
            "--history",
            str(tmp_path / "history"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert culprit in err and err.startswith("ferry: error:")
    assert not (tmp_path / "history").exists() and not (tmp_path / "work").exists()


@pytest.mark.parametrize(
    "argv, culprit",
    [
        (["--steps", "1"], "--steps must be at least 2"),
        (["--steps", "10", "--switch-at", "10"], "--switch-at must lie in [1, 9]"),
        (["--profile", "loose"], "unknown tolerance profile 'loose'"),
        (["train.steps=lots"], "train.steps"),
    ],
)
def test_bad_rehearsal_options_exit_2(argv, culprit, tmp_path, capsys):
    code = main(
        [
            "rehearse",
            str(REPO / "configs" / "tiny.yaml"),
            "--from",
            "cpu",
            "--to",
            "cpu",
            *argv,
            "--dir",
            str(tmp_path / "work"),
            "--history",
            str(tmp_path / "history"),
        ]
    )
    assert code == 2
    assert culprit in capsys.readouterr().err
    assert not (tmp_path / "history").exists()


def test_a_non_empty_rehearsal_directory_is_never_overwritten(tmp_path, capsys):
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("earlier results")
    code = main(
        [
            "rehearse",
            str(REPO / "configs" / "tiny.yaml"),
            "--from",
            "cpu",
            "--to",
            "cpu",
            "--dir",
            str(work),
            "--history",
            str(tmp_path / "history"),
        ]
    )
    assert code == 2 and "not empty" in capsys.readouterr().err
    assert (work / "keep.txt").read_text() == "earlier results"
