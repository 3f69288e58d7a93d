"""`ferry compare`: tolerance profiles, the judgement, its outputs and exit codes, on synthetic and real runs."""

import argparse
import json
import math
import re

import pytest

from ferry.cli.metrics import add_metrics_commands
from ferry.config import UserError
from ferry.metrics import METRICS_FILE
from ferry.portability import compare_runs, tolerance_profile, tolerance_profiles
from ferry.portability.tolerances import TOLERANCES_FILE
from ferry.train import train


def write_run(run_dir, losses, first_step=1):
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": first_step + i, "loss": loss, "lr": 1e-3}) for i, loss in enumerate(losses)]
    (run_dir / METRICS_FILE).write_text("\n".join(lines) + "\n")
    return run_dir


def cli(*argv):
    parser = argparse.ArgumentParser()
    add_metrics_commands(parser.add_subparsers())
    args = parser.parse_args(list(argv))
    return args.handler(args)


CURVE = [6.0 - 0.02 * step for step in range(30)]


def test_the_three_profiles_exist_and_every_number_has_its_reason():
    assert list(tolerance_profiles()) == ["bitwise", "same-hardware", "cross-accelerator"]
    bitwise = tolerance_profile("bitwise")
    assert bitwise.rtol == bitwise.atol == 0.0 and bitwise.window == 1
    numbers = [
        line
        for line in TOLERANCES_FILE.read_text().splitlines()
        if re.match(r"\s+(steps|window|min_steps|rtol|atol):", line)
    ]
    assert len(numbers) == 15
    assert all(re.search(r"#\s*\S", line) for line in numbers), "a tolerance without its reason"


def test_identical_runs_pass_bitwise_and_write_plot_and_verdict(tmp_path):
    a = write_run(tmp_path / "a", CURVE)
    b = write_run(tmp_path / "b", CURVE)
    verdict = compare_runs(a, b, profile="bitwise")
    assert verdict.passed and verdict.steps_compared == 30 and verdict.steps_requested == 100
    assert verdict.max_abs_diff == 0.0 and verdict.first_failing_step is None
    assert (b / "compare-loss.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((b / "compare-loss.json").read_text())
    assert saved["passed"] is True and saved["profile"] == "bitwise" and saved["tolerance"]["rtol"] == 0.0


def test_one_ulp_fails_bitwise_but_passes_same_hardware(tmp_path):
    a = write_run(tmp_path / "a", CURVE)
    b = write_run(tmp_path / "b", CURVE[:10] + [math.nextafter(CURVE[10], 0)] + CURVE[11:])
    assert not compare_runs(a, b, profile="bitwise").passed
    assert compare_runs(a, b, profile="bitwise").first_failing_step == 11
    assert compare_runs(a, b, profile="same-hardware").passed


def test_a_systematic_shift_fails_at_the_step_it_leaves_the_band(tmp_path):
    a = write_run(tmp_path / "a", CURVE)
    b = write_run(tmp_path / "b", [loss * (1.03 if step >= 15 else 1.0) for step, loss in enumerate(CURVE, start=1)])
    verdict = compare_runs(a, b, profile="same-hardware")
    assert not verdict.passed
    assert 15 <= verdict.first_failing_step <= 17
    assert compare_runs(a, b, profile="same-hardware", steps=14).passed


def test_a_nan_fails_and_the_verdict_stays_valid_json(tmp_path):
    a = write_run(tmp_path / "a", CURVE)
    b = write_run(tmp_path / "b", CURVE[:5] + [float("nan")] + CURVE[6:])
    verdict = compare_runs(a, b, profile="cross-accelerator")
    assert not verdict.passed and verdict.first_failing_step == 6 and verdict.max_abs_diff is None
    json.loads((b / "compare-loss.json").read_text(), parse_constant=pytest.fail)


def test_only_common_steps_are_judged(tmp_path):
    a = write_run(tmp_path / "a", CURVE)
    b = write_run(tmp_path / "b", CURVE[:12])
    verdict = compare_runs(a, b, profile="bitwise", steps=20)
    assert verdict.passed and verdict.steps_compared == 12 and verdict.last_step == 12
    assert "12 steps of the 20 requested" in verdict.summary()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["compare", "{a}", "{missing}"], "neither a run directory"),
        (["compare", "{a}", "{b}", "--metric", "los"], "no metric 'los'; numeric metrics there: loss, lr"),
        (["compare", "{a}", "{b}", "--profile", "close-enough"], "unknown tolerance profile 'close-enough'"),
        (["compare", "{a}", "{b}", "--steps", "0"], "--steps must be at least 1"),
        (["compare", "{a}", "{late}"], "no step in common"),
    ],
)
def test_bad_input_is_a_user_error_naming_the_culprit(tmp_path, argv, message):
    paths = {
        "a": write_run(tmp_path / "a", CURVE),
        "b": write_run(tmp_path / "b", CURVE),
        "late": write_run(tmp_path / "late", CURVE, first_step=100),
        "missing": tmp_path / "missing",
    }
    with pytest.raises(UserError, match=re.escape(message)) as caught:
        cli(*[part.format(**paths) for part in argv])
    assert caught.value.exit_code == 2


def test_exit_codes_pass_and_fail(tmp_path, capsys):
    a = write_run(tmp_path / "a", CURVE)
    b = write_run(tmp_path / "b", [loss + 0.5 for loss in CURVE])
    out = tmp_path / "verdicts"
    assert cli("compare", str(a), str(a), "--output", str(out)) == 0
    assert "PASS" in capsys.readouterr().out
    assert cli("compare", str(a), str(b), "--output", str(out)) == 1
    assert "FAIL (first outside tolerance at step 1)" in capsys.readouterr().out
    assert sorted(path.name for path in out.iterdir()) == ["compare-loss.json", "compare-loss.png"]


def test_real_runs_identical_pass_changed_learning_rate_fails(make_config, tmp_path):
    """Real trainer runs: a rerun is bitwise equal, a micro-batch change is benign, a learning-rate change is not."""
    steps = "train.steps=8"
    reference = train(make_config(steps, run_dir=tmp_path / "reference")).run_dir
    rerun = train(make_config(steps, run_dir=tmp_path / "rerun")).run_dir
    split = train(make_config(steps, "train.micro_batch=2", run_dir=tmp_path / "split")).run_dir
    faster = train(make_config(steps, "optim.lr=6e-3", run_dir=tmp_path / "faster")).run_dir

    assert compare_runs(reference, rerun, profile="bitwise").passed
    assert compare_runs(reference, split, profile="same-hardware").passed
    changed = compare_runs(reference, faster, profile="same-hardware")
    assert not changed.passed and changed.steps_compared == 8
    assert (faster / "compare-loss.png").is_file() and (faster / "compare-loss.json").is_file()
