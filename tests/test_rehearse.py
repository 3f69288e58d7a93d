"""`ferry rehearse`: real moves between CPU environments, the verdict, the bundle, and bad input.

Every rehearsal here is the whole drill with the tiny model: a source run in its own
processes (two ranks for cpu-ep2), a target resumed from the switch checkpoint, a
target from scratch, both judged against the source.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import yaml
from conftest import REPO, TINY_RUN

from ferry.cli.main import main
from ferry.portability.report.history import REHEARSALS, read_records

# windows long enough to prove a move under each profile (tolerances.yaml min_steps: same-hardware 25,
# cross-accelerator 50), and a short one that can only be inconclusive
LAYOUT = ["--steps", "35", "--switch-at", "25"]
PRECISION = ["--steps", "60", "--switch-at", "50"]
SHORT = ["--steps", "20", "--switch-at", "10"]


@pytest.fixture(scope="module")
def space(tmp_path_factory, stdlib_dataset):
    """A config file of the tiny model and a history directory shared by the rehearsals of this module."""
    root = tmp_path_factory.mktemp("rehearse")
    raw = json.loads(json.dumps(TINY_RUN))
    raw["data"]["sources"] = [{"name": "stdlib", "path": str(stdlib_dataset)}]
    raw["train"]["steps"] = 20
    config = root / "tiny.yaml"
    config.write_text(yaml.safe_dump(raw))
    return {"root": root, "config": str(config), "history": root / "portability"}


def _rehearse(space, *argv):
    return main(["rehearse", *argv, "--history", str(space["history"])])


def _history(space):
    return [record for _, record in read_records(space["history"], REHEARSALS)]


@pytest.fixture(scope="module")
def ep2_to_cpu(space):
    """The layout move: two ranks with experts split and ZeRO-1, resumed on one rank."""
    work = space["root"] / "ep2-to-cpu"
    code = _rehearse(space, space["config"], "--from", "cpu-ep2", "--to", "cpu", *LAYOUT, "--dir", str(work))
    return code, json.loads((work / "verdict.json").read_text()), work


def test_a_layout_move_passes_under_same_hardware_with_its_state_carried(ep2_to_cpu, space):
    code, record, work = ep2_to_cpu
    assert code == 0 and record["passed"] and record["verdict"] == "PASS"
    assert record["profile"] == "same-hardware" and "parallel.ep" in record["profile_reason"]
    resumed, scratch = record["comparisons"]["resumed"], record["comparisons"]["scratch"]
    assert (resumed["first_step"], resumed["last_step"], resumed["steps_compared"]) == (26, 35, 10)
    assert (scratch["first_step"], scratch["last_step"]) == (1, 25)
    assert record["worst"]["max_abs_diff_step"] in range(1, 36) and record["conclusive"]
    carried = record["carried"]
    for part in ("weights", "optimizer", "data_cursor", "schedule"):
        assert carried[part].startswith("carried"), part
    assert carried["rng"].startswith("not carried") and "2 ranks" in carried["rng"]
    lead = record["lead_time"]
    assert 0 < lead["verify_s"] < lead["first_step_s"] < lead["judged_s"]
    assert lead["restore_s"] > 0 and lead["bundle_check_s"] > 0
    assert record["throughput"]["source_tokens_per_s"] > 0 and record["throughput"]["target_tokens_per_s"] > 0
    for side, ranks in (("source", 2), ("target", 1)):  # how busy the machine was is not asserted: it varies
        measured = record["throughput"][f"{side}_conditions"]
        assert measured["ranks"] == ranks and measured["logical_cores"] == os.cpu_count()
        assert measured["torch_threads"] == record["fingerprints"][side]["cpu_threads"]
        assert measured["load_samples"] >= 2 and isinstance(measured["under_load"], bool)
    source_run = json.loads((work / "source" / "run.json").read_text())
    assert source_run["layout"] == {"world_size": 2, "ep_degree": 2, "mode": "ep"}
    assert source_run["config"]["optim"]["zero"] is True
    assert (work / "bundle" / "checkpoint" / "step-00000025" / "manifest.json").is_file()
    assert record in _history(space)


@pytest.fixture(scope="module")
def cpu_to_bf16(space):
    work = space["root"] / "cpu-to-bf16"
    code = _rehearse(
        space, space["config"], "--from", "cpu", "--to", "cpu-bf16-portable", *PRECISION, "--dir", str(work)
    )
    return code, json.loads((work / "verdict.json").read_text())


def test_a_precision_and_kernel_move_passes_under_cross_accelerator(cpu_to_bf16):
    code, record = cpu_to_bf16
    assert code == 0 and record["passed"]
    assert record["profile"] == "cross-accelerator" and "precision.compute_dtype" in record["profile_reason"]
    lost = {row["op"]: row for row in record["portable_on_target"]}
    assert "moe.routed_experts" in lost and lost["moe.routed_experts"]["vendor_implementation"] == "fused_loop@cpu"
    assert "1.62x" in lost["moe.routed_experts"]["ledger_measured_gain"]


@pytest.fixture(scope="module")
def bundle(space):
    """The source half on its own, written as a bundle."""
    out = space["root"] / "machine-a" / "bundle"
    code = main(["rehearse", "start", space["config"], "--from", "cpu", "--out", str(out), *PRECISION])
    assert code == 0
    return out


def test_start_and_finish_in_two_directories_give_the_one_machine_verdict(bundle, cpu_to_bf16, space):
    work = space["root"] / "machine-b" / "finish"
    code = main(
        [
            "rehearse",
            "finish",
            str(bundle),
            "--to",
            "cpu-bf16-portable",
            "--dir",
            str(work),
            "--history",
            str(space["history"]),
        ]
    )
    split = json.loads((work / "verdict.json").read_text())
    _, together = cpu_to_bf16
    assert code == 0 and split["passed"]
    for name in ("resumed", "scratch"):
        for key in ("passed", "max_abs_diff", "max_rel_diff", "worst_step", "steps_compared"):
            assert split["comparisons"][name][key] == together["comparisons"][name][key], (name, key)
    assert split["profile"] == together["profile"]
    assert split["bundle"] == str(bundle)


def test_a_target_that_changes_the_learning_rate_by_20_percent_fails(space, capsys):
    cpu = yaml.safe_load((REPO / "configs" / "environments" / "cpu.yaml").read_text())
    cpu["name"] = "cpu-lr-x1.2"
    cpu["overrides"]["optim.lr"] = TINY_RUN["optim"]["lr"] * 1.2
    target = space["root"] / "cpu-lr.yaml"
    target.write_text(yaml.safe_dump(cpu))
    work = space["root"] / "lr"
    before = len(_history(space))
    code = _rehearse(
        space,
        space["config"],
        "--from",
        "cpu",
        "--to",
        str(target),
        "--steps",
        "60",
        "--switch-at",
        "30",
        "--dir",
        str(work),
    )
    record = json.loads((work / "verdict.json").read_text())
    assert code == 1 and not record["passed"] and record["verdict"] == "FAIL"
    assert record["profile"] == "cross-accelerator" and "optim.lr" in record["profile_reason"]
    assert not record["comparisons"]["scratch"]["passed"]
    assert "FAIL" in capsys.readouterr().out
    assert len(_history(space)) == before + 1 and _history(space)[-1]["verdict"] == "FAIL"


def test_h100_to_mi300x_numerics_rehearses_fp8_in_both_variants(space):
    """A short window: it runs both FP8 variants and records the verdict, which proves nothing yet."""
    work = space["root"] / "fp8"
    _rehearse(space, space["config"], "--from", "h100-numerics", "--to", "mi300x-numerics", *SHORT, "--dir", str(work))
    record = json.loads((work / "verdict.json").read_text())
    assert record["conclusive"] is False and "shorter than the 50" in record["inconclusive_reason"]
    source = json.loads((work / "source" / "run.json").read_text())["precision"]
    target = json.loads((work / "target-resumed" / "run.json").read_text())["precision"]
    assert source["experts_formats"]["forward"] == "torch.float8_e4m3fn" and source["experts_mode"] == "emulated"
    assert target["experts_formats"]["forward"] == "torch.float8_e4m3fnuz" and target["compute_dtype"] == "bf16"
    assert record["profile"] == "cross-accelerator" and "precision.profile" in record["profile_reason"]
    assert record in _history(space)


def _tampered(bundle, tmp_path, change):
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    change(copy)
    return copy


def _flip_a_byte(copy):
    tensor = next((copy / "checkpoint" / "step-00000050").glob("model-*.safetensors"))
    data = bytearray(tensor.read_bytes())
    data[-1] ^= 0xFF
    tensor.write_bytes(bytes(data))


def _edit(copy, change):
    description = json.loads((copy / "bundle.json").read_text())
    change(description)
    (copy / "bundle.json").write_text(json.dumps(description))


def _forge_lr(description):
    """Change the learning rate and write a matching config digest: only the reference config tells."""
    from ferry.portability.rehearsal.bundle import config_digest

    description["config"]["resolved"]["optim"]["lr"] = 1e-2
    description["config"]["digest"] = config_digest(description["config"]["resolved"])


BAD_BUNDLES = {
    "a flipped byte": (_flip_a_byte, "tampered with or damaged: checkpoint/step-00000050/model"),
    "a missing file": (lambda c: (c / "reference" / "metrics.jsonl").unlink(), "incomplete: reference/metrics.jsonl"),
    "an extra file": (
        lambda c: (c / "checkpoint" / "step-00000050" / "extra.safetensors").write_bytes(b"x"),
        "holds files no digest lists: checkpoint/step-00000050/extra.safetensors",
    ),
    "a changed learning rate in bundle.json": (
        lambda c: _edit(c, lambda d: d["config"]["resolved"]["optim"].update(lr=1e-2)),
        "its resolved config does not match its digest",
    ),
    "a forged config digest": (lambda c: _edit(c, _forge_lr), "does not describe the run its reference config records"),
    "a step count that is text": (
        lambda c: _edit(c, lambda d: d.update(steps="60")),
        "bundle.json is malformed at steps",
    ),
    "data that is not a list": (
        lambda c: _edit(c, lambda d: d.update(data="stdlib")),
        "bundle.json is malformed at data",
    ),
    "another switch step": (lambda c: _edit(c, lambda d: d.update(switch_at=40)), "its checkpoint is of step 50"),
    "no bundle.json": (lambda c: (c / "bundle.json").unlink(), "not a rehearsal bundle"),
}


@pytest.mark.parametrize("case", sorted(BAD_BUNDLES))
def test_a_damaged_bundle_is_refused_and_nothing_is_recorded(case, bundle, space, tmp_path, capsys):
    change, message = BAD_BUNDLES[case]
    copy = _tampered(bundle, tmp_path, change)
    before = len(_history(space))
    code = main(
        [
            "rehearse",
            "finish",
            str(copy),
            "--to",
            "cpu",
            "--dir",
            str(tmp_path / "work"),
            "--history",
            str(space["history"]),
        ]
    )
    assert code == 2
    assert message in capsys.readouterr().err
    assert len(_history(space)) == before
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize(
    "override, message",
    [("model.dim=64", "another model than the target's"), ("data.sources.0.path={other}", "is not the dataset")],
)
def test_a_target_of_another_model_or_data_is_refused(override, message, bundle, space, tmp_path, capsys):
    from ferry.data import PrepareSpec, prepare_dataset

    other = tmp_path / "other-data"
    if "{other}" in override:
        prepare_dataset(PrepareSpec(embedded="stdlib", embedded_max_bytes=100_000, vocab_size=300), other)
    before = len(_history(space))
    code = main(
        [
            "rehearse",
            "finish",
            str(bundle),
            "--to",
            "cpu",
            override.format(other=other),
            "--dir",
            str(tmp_path / "work"),
            "--history",
            str(space["history"]),
        ]
    )
    assert code == 2
    assert message in capsys.readouterr().err
    assert len(_history(space)) == before


def test_the_report_lists_exactly_the_paths_that_passed(ep2_to_cpu, cpu_to_bf16, space, tmp_path):
    from ferry.portability.report.report import write_report

    write_report(space["history"], tmp_path / "report")
    alternatives = json.loads((tmp_path / "report" / "report.json").read_text())["alternatives"]
    latest = {}
    for record in _history(space):
        latest[(record["source"]["name"], record["target"]["name"])] = record["passed"] and record["conclusive"]
    proven = {(row["source"], row["target"]) for row in alternatives if row["status"] == "proven"}
    assert proven == {path for path, passed in latest.items() if passed}
    assert ("cpu-ep2", "cpu") in proven and ("cpu", "cpu-bf16-portable") in proven
    assert ("cpu", "cpu-lr-x1.2") not in proven and ("h100-numerics", "mi300x-numerics") not in proven


def test_finish_elsewhere_with_the_data_at_another_path_is_judged_as_here(bundle, cpu_to_bf16, space, tmp_path):
    moved = tmp_path / "data-elsewhere"
    shutil.copytree(json.loads((bundle / "bundle.json").read_text())["data"][0]["path"], moved)
    work = tmp_path / "finish"
    assert (
        main(
            [
                "rehearse",
                "finish",
                str(bundle),
                "--to",
                "cpu-bf16-portable",
                f"data.sources.0.path={moved}",
                "--dir",
                str(work),
                "--history",
                str(tmp_path / "history"),
            ]
        )
        == 0
    )
    record = json.loads((work / "verdict.json").read_text())
    _, together = cpu_to_bf16
    assert record["profile"] == together["profile"] and record["config"]["digest"] == together["config"]["digest"]
    assert record["finish_overrides"] == [f"data.sources.0.path={moved}"]
    assert record["comparisons"]["resumed"]["max_abs_diff"] == together["comparisons"]["resumed"]["max_abs_diff"]


def test_rehearse_help_and_options_before_the_config(capsys):
    assert main(["rehearse", "--help"]) == 0
    assert "ferry rehearse start" in capsys.readouterr().out
    assert main(["rehearse"]) == 2
    assert main(["rehearse", "--from", "cpu", "--to", "nowhere", str(REPO / "configs" / "tiny.yaml")]) == 2
    assert "'nowhere' is neither a file nor a known environment" in capsys.readouterr().err


def test_a_profile_judged_against_seeds_is_refused_where_no_seed_runs_exist(bundle, space, tmp_path, capsys):
    """The source trains seed runs only for an objective that samples its data: asking for `sampled` on the
    next-token objective is refused before anything trains, and so is finishing a bundle without them."""
    work = tmp_path / "work"
    argv = [space["config"], "--from", "cpu", "--to", "cpu", "--profile", "sampled", *SHORT, "--dir", str(work)]
    assert _rehearse(space, *argv) == 2
    assert "which the source measures only for an objective that samples its data (grpo), not lm" in (
        capsys.readouterr().err
    )
    assert not work.exists()
    before = len(_history(space))
    finish = ["rehearse", "finish", str(bundle), "--to", "cpu", "--profile", "sampled", "--dir", str(work)]
    assert main([*finish, "--history", str(space["history"])]) == 2
    assert "carries 0 seed run(s) of the 2 it needs" in capsys.readouterr().err
    assert len(_history(space)) == before and not (work / "target-resumed").exists()


def test_a_bundle_reached_through_a_symbolic_link_is_read(bundle, tmp_path):
    """Links inside a bundle are refused (a seed run linked to the reference); the bundle's own path may be one."""
    from ferry.portability.rehearsal.bundle import read_bundle

    link = tmp_path / "bundle-link"
    link.symlink_to(bundle, target_is_directory=True)
    assert read_bundle(link).steps == read_bundle(bundle).steps


@pytest.mark.parametrize("form", ["rehearse", "start"])
def test_weights_drawn_on_each_device_are_refused_before_anything_trains(form, space, tmp_path, capsys):
    """With `run.init_device: run` each environment draws its own initial weights, so the target's run from
    scratch would not start where the source's did: both forms that train a source refuse it."""
    work = tmp_path / "work"
    if form == "rehearse":
        argv = [
            "rehearse",
            space["config"],
            "run.init_device=run",
            "--from",
            "cpu",
            "--to",
            "cpu",
            *SHORT,
            "--dir",
            str(work),
            "--history",
            str(space["history"]),
        ]
    else:
        argv = [
            "rehearse",
            "start",
            space["config"],
            "run.init_device=run",
            "--from",
            "cpu",
            "--out",
            str(tmp_path / "bundle"),
            *SHORT,
            "--dir",
            str(work),
        ]
    assert main(argv) == 2
    assert "run.init_device is run" in capsys.readouterr().err
    assert not work.exists() and not (tmp_path / "bundle").exists()
