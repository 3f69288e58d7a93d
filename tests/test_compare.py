"""`ferry compare`: tolerance profiles, the judgement, its outputs and exit codes, on synthetic and real runs."""

import argparse
import json
import math
import re

import numpy as np
import pytest

from ferry.cli.metrics import add_metrics_commands
from ferry.config import UserError
from ferry.metrics import METRICS_FILE
from ferry.portability import compare_runs, tolerance_profile, tolerance_profiles
from ferry.portability.comparison.compare import NoSpread
from ferry.portability.comparison.tolerances import TOLERANCES_FILE
from ferry.train import train


def write_run(run_dir, losses, first_step=1, metric="loss"):
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": first_step + i, metric: loss, "lr": 1e-3}) for i, loss in enumerate(losses)]
    (run_dir / METRICS_FILE).write_text("\n".join(lines) + "\n")
    return run_dir


def cli(*argv):
    parser = argparse.ArgumentParser()
    add_metrics_commands(parser.add_subparsers())
    args = parser.parse_args(list(argv))
    return args.handler(args)


CURVE = [6.0 - 0.02 * step for step in range(30)]


def test_the_profiles_exist_and_every_number_has_its_reason():
    assert list(tolerance_profiles()) == [
        "bitwise",
        "same-hardware",
        "cross-accelerator",
        "sampled",
        "layout",
        "layout-bf16",
    ]
    bitwise = tolerance_profile("bitwise")
    assert bitwise.rtol == bitwise.atol == 0.0 and bitwise.window == 1
    assert bitwise.metric == "loss" and bitwise.seeds == 0
    sampled = tolerance_profile("sampled")
    assert sampled.metric == "reward" and sampled.seeds >= 2 and sampled.spread_z > 0
    numbers = [
        line
        for line in TOLERANCES_FILE.read_text().splitlines()
        if re.match(r"\s+(metric|steps|window|min_steps|rtol|atol|seeds|spread_z):", line)
    ]
    assert len(numbers) == 33
    assert all(re.search(r"#\s*\S", line) for line in numbers), "a tolerance without its reason"


def test_a_band_in_seed_spreads_needs_seed_runs_and_the_reverse():
    from ferry.portability.comparison.tolerances import ToleranceProfile

    fixed = {"description": "x", "steps": 10, "window": 5, "min_steps": 5, "rtol": 0.0, "atol": 0.0}
    assert ToleranceProfile(**fixed, seeds=2, spread_z=4.0).seeds == 2
    for lopsided in ({"seeds": 2}, {"spread_z": 4.0}):
        with pytest.raises(ValueError, match="seeds and spread_z go together"):
            ToleranceProfile(**fixed, **lopsided)


def noisy_rewards(seed, shift=0.0, steps=40):
    """A rising reward with the per-step noise of 128 sampled completions (sd ~0.04), as a seed draws it."""
    generator = np.random.default_rng(seed)
    return [min(1.0, 0.6 + 0.008 * step + shift + generator.normal(0.0, 0.04)) for step in range(steps)]


def test_a_sampled_run_is_judged_against_the_spread_between_seeds(tmp_path):
    a = write_run(tmp_path / "a", noisy_rewards(0), metric="reward")
    seeds = [str(write_run(tmp_path / f"seed{k}", noisy_rewards(k), metric="reward")) for k in (1, 2)]
    other_draws = write_run(tmp_path / "b", noisy_rewards(3), metric="reward")
    verdict = compare_runs(a, other_draws, profile="sampled", seed_runs=seeds)
    assert verdict.passed and verdict.metric == "reward" and verdict.seed_runs == seeds
    # three noise draws of sd 0.04 under a 10-step mean: pairs differ by about 0.04 * sqrt(2 / 10)
    assert 0.01 < verdict.seed_spread < 0.04
    assert "x the seed spread" in verdict.summary()
    assert json.loads((other_draws / "compare-reward.json").read_text())["seed_spread"] == verdict.seed_spread
    shifted = write_run(tmp_path / "shifted", noisy_rewards(3, shift=-0.15), metric="reward")
    failed = compare_runs(a, shifted, profile="sampled", seed_runs=seeds)
    assert not failed.passed and failed.first_failing_step <= 10
    assert failed.seed_spread == verdict.seed_spread  # the band is A's and its seed runs', whatever B is
    assert verdict.max_bound_fraction <= 1 < failed.max_bound_fraction
    # the same difference judged step by step under a fixed band would fail the unshifted draw too
    assert not compare_runs(a, other_draws, profile="cross-accelerator", metric="reward").passed


@pytest.mark.parametrize(
    "profile, seed_runs, message",
    [
        ("sampled", ["{s1}"], "needs 2 run(s) of run A's config with other seeds (--seed-run), got 1"),
        ("same-hardware", ["{s1}", "{s2}"], "profile same-hardware has a fixed band and takes no seed runs"),
        (
            "sampled",
            ["{s1}", "{short}"],
            "seed run {short} has no 'reward' at 20 of the judged steps (first 21, last 40)",
        ),
        ("sampled", ["{s1}", "{broken}"], "seed run {broken} has a non-finite 'reward' at step 4"),
        ("sampled", ["{s1}", "{s1}"], "seed run {s1} is another seed run again"),
        ("sampled", ["{s1}", "{a}"], "seed run {a} is run A again"),
        ("sampled", ["{same_as_a}", "{same_as_a_too}"], "drew the same 'reward' as {a} at every step of 1..40"),
    ],
)
def test_bad_seed_runs_are_refused_naming_them(tmp_path, profile, seed_runs, message):
    paths = {
        "a": write_run(tmp_path / "a", noisy_rewards(0), metric="reward"),
        "b": write_run(tmp_path / "b", noisy_rewards(5), metric="reward"),
        "same_as_a": write_run(tmp_path / "same_as_a", noisy_rewards(0), metric="reward"),
        "same_as_a_too": write_run(tmp_path / "same_as_a_too", noisy_rewards(0), metric="reward"),
        "s1": write_run(tmp_path / "s1", noisy_rewards(1), metric="reward"),
        "s2": write_run(tmp_path / "s2", noisy_rewards(2), metric="reward"),
        "short": write_run(tmp_path / "short", noisy_rewards(3, steps=20), metric="reward"),
        "broken": write_run(
            tmp_path / "broken", noisy_rewards(4)[:3] + [float("nan")] + noisy_rewards(4)[4:], metric="reward"
        ),
    }
    argv = ["compare", str(paths["a"]), str(paths["b"]), "--profile", profile, "--metric", "reward"]
    for run in seed_runs:
        argv += ["--seed-run", run.format(**paths)]
    with pytest.raises(UserError, match=re.escape(message.format(**paths))) as caught:
        cli(*argv)
    assert caught.value.exit_code == 2
    assert isinstance(caught.value, NoSpread) == message.startswith("drew the same")  # a broken run is no band of 0


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


def test_the_share_of_its_bound_a_comparison_used_is_recorded(tmp_path):
    a = write_run(tmp_path / "a", CURVE)
    within = compare_runs(a, write_run(tmp_path / "b", [loss * 1.003 for loss in CURVE]), profile="same-hardware")
    assert within.passed and within.max_bound_fraction == pytest.approx(0.5, rel=1e-9)  # 3e-3 of rtol 6e-3
    outside = compare_runs(a, write_run(tmp_path / "c", [loss * 1.009 for loss in CURVE]), profile="same-hardware")
    assert not outside.passed and outside.max_bound_fraction == pytest.approx(1.5, rel=1e-9)
    assert compare_runs(a, a, profile="bitwise", output_dir=tmp_path / "v").max_bound_fraction is None  # zero bound


def test_a_nan_fails_and_the_verdict_stays_valid_json(tmp_path):
    a = write_run(tmp_path / "a", CURVE)
    b = write_run(tmp_path / "b", CURVE[:5] + [float("nan")] + CURVE[6:])
    verdict = compare_runs(a, b, profile="cross-accelerator")
    assert not verdict.passed and verdict.first_failing_step == 6 and verdict.max_abs_diff is None
    json.loads((b / "compare-loss.json").read_text(), parse_constant=pytest.fail)


@pytest.mark.parametrize("damage", ["line missing", "null", "text"])
def test_a_step_one_run_lacks_or_holds_as_a_non_number_fails_even_bitwise(tmp_path, damage):
    a = write_run(tmp_path / "a", CURVE)
    b = write_run(tmp_path / "b", CURVE)
    path = b / METRICS_FILE
    records = [json.loads(line) for line in path.read_text().splitlines()]
    if damage == "line missing":
        del records[14]
    else:
        records[14]["loss"] = None if damage == "null" else "x"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    verdict = compare_runs(a, b, profile="bitwise", steps=20)
    assert not verdict.passed and verdict.first_failing_step == 15 and verdict.steps_compared == 20
    if damage == "line missing":
        assert verdict.missing_steps == {"15": ["B"]}
        assert "1 step(s) recorded by one run only (first: step 15, missing from run B)" in verdict.summary()


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


def test_a_non_finite_reference_measures_no_spread_and_a_zero_reward_is_judged(tmp_path):
    a_rewards = noisy_rewards(0)
    broken = write_run(tmp_path / "broken", a_rewards[:29] + [float("nan")] + a_rewards[30:], metric="reward")
    seeds = [str(write_run(tmp_path / f"seed{k}", noisy_rewards(k), metric="reward")) for k in (1, 2)]
    b = write_run(tmp_path / "b", noisy_rewards(3), metric="reward")
    broken_reference = "run A .*broken has a non-finite 'reward' at step 30: it measures no spread"
    with pytest.raises(UserError, match=broken_reference) as caught:
        compare_runs(broken, b, profile="sampled", seed_runs=seeds)
    assert not isinstance(caught.value, NoSpread)  # broken, not a band of width 0 that a bitwise check could replace
    # a policy that solves nothing yet: A's windowed reward is 0, and the verdict and its summary still stand
    zeros = [0.0] * 5
    a = write_run(tmp_path / "a", zeros + a_rewards[5:], metric="reward")
    seeds = [str(write_run(tmp_path / f"z{k}", zeros + noisy_rewards(k)[5:], metric="reward")) for k in (1, 2)]
    verdict = compare_runs(
        a, write_run(tmp_path / "b0", zeros + noisy_rewards(3)[5:], metric="reward"), profile="sampled", seed_runs=seeds
    )
    assert verdict.passed and verdict.max_rel_diff is not None and "PASS" in verdict.summary()
    early = compare_runs(
        a,
        write_run(tmp_path / "b1", [0.5] + zeros[1:] + a_rewards[5:], metric="reward"),
        profile="sampled",
        seed_runs=seeds,
    )
    assert not early.passed and early.first_failing_step == 1 and early.max_rel_diff is None  # 0.5 against 0
    assert early.max_bound_fraction > 1 and "relative" not in early.summary().split("max |diff|")[1].split(",")[0]


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


def test_the_worst_comparison_is_the_one_that_used_most_of_its_bound(tmp_path):
    """Under a band in seed spreads a relative deviation says nothing of the bound: the pick follows the share."""
    from ferry.portability.rehearsal.record import worst_comparison

    rewards = noisy_rewards(0)
    a = write_run(tmp_path / "a", rewards, metric="reward")
    seeds = [str(write_run(tmp_path / f"seed{k}", noisy_rewards(k), metric="reward")) for k in (1, 2)]
    # one far-off first step (a band four times wider there) against a small shift that lasts
    first_step_off = write_run(tmp_path / "first", [rewards[0] + 0.15, *rewards[1:]], metric="reward")
    shifted = write_run(tmp_path / "shifted", [reward + 0.06 for reward in rewards], metric="reward")
    early = compare_runs(a, first_step_off, profile="sampled", seed_runs=seeds, output_dir=tmp_path / "v1")
    lasting = compare_runs(a, shifted, profile="sampled", seed_runs=seeds, output_dir=tmp_path / "v2")
    assert early.max_rel_diff > lasting.max_rel_diff and early.max_bound_fraction < lasting.max_bound_fraction
    worst = worst_comparison({"scratch": early, "resumed": lasting})
    assert worst["comparison"] == "resumed" and worst["max_bound_fraction"] == lasting.max_bound_fraction
