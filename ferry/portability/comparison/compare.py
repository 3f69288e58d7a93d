"""`ferry compare RUN_A RUN_B`: do two runs' trajectories agree within a tolerance fixed in advance?

Run A is the reference, run B the candidate (another device, kernel, backend,
precision or layout). The judgement covers the first N steps because that is where
a divergence is cheapest to catch, and where a mismatch in data order, seeding or
numerics shows before it drowns in training noise. Both inputs must have recorded
the same steps: a step that one run recorded the metric at and the other did not fails, as a
non-finite or non-numeric value does. The verdict is written as JSON and drawn as a PNG next to run B.

An objective that draws its own training data (GRPO's rollouts) cannot be judged step by
step: one sampled token on the other side of a probability boundary sends two runs onto
different rollouts for good. A profile with `seeds` judges such runs against runs that
differ from A only in their seed: its band is `spread_z` times their spread, the RMS of the
windowed differences between every pair of them, so a move passes when it changes the
trajectory no more than drawing other samples does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from itertools import combinations
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ferry.config import UserError
from ferry.metrics.jsonl import metrics_path, read_metrics
from ferry.metrics.plots import new_figure, save_figure
from ferry.portability.comparison.tolerances import ToleranceProfile, tolerance_profile

DEFAULT_PROFILE = "same-hardware"


class NoSpread(UserError):
    """The seed runs drew exactly what run A drew at every judged step: there is no band to judge run B in (a
    caller may then ask for run B to draw the same values, bit for bit)."""


@dataclass
class Verdict:
    """What was compared, how, and the outcome; `as_dict()` is the JSON verdict file."""

    passed: bool
    profile: str
    tolerance: dict
    metric: str
    run_a: str
    run_b: str
    steps_requested: int
    steps_compared: int
    first_step: int
    last_step: int
    max_abs_diff: float | None
    max_rel_diff: float | None
    worst_step: int
    first_failing_step: int | None
    plot: str
    verdict_file: str
    seed_runs: list[str] = field(default_factory=list)
    seed_spread: float | None = None
    max_bound_fraction: float | None = None  # largest |diff| / bound over the steps (> 1 fails; None: not finite)
    missing_steps: dict[str, list[str]] = field(default_factory=dict)  # step -> the runs (A, B) without a value there

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        outcome = "PASS" if self.passed else f"FAIL (first outside tolerance at step {self.first_failing_step})"
        shortfall = f" of the {self.steps_requested} requested" if self.steps_compared < self.steps_requested else ""
        if self.max_abs_diff is None:
            largest = "a non-finite value"
        else:
            relative = f" (relative {self.max_rel_diff:.3g})" if self.max_rel_diff is not None else ""
            largest = f"max |diff| {self.max_abs_diff:.3g}{relative}"
        spread = ""
        if self.seed_runs:
            spread = (
                f", band {self.tolerance['spread_z']:g} x the seed spread {self.seed_spread:.3g} "
                f"({len(self.seed_runs)} seed run(s) beside A)"
            )
        gaps = ""
        if self.missing_steps:
            first_gap, roles = next(iter(self.missing_steps.items()))
            gaps = (
                f"; {len(self.missing_steps)} step(s) recorded by one run only (first: step {first_gap}, missing "
                f"from run {' and '.join(roles)}), each failing"
            )
        return (
            f"{outcome}: {self.metric} of {self.run_b} vs {self.run_a} under profile {self.profile} — "
            f"{self.steps_compared} steps{shortfall} (steps {self.first_step}..{self.last_step}), "
            f"{largest} at step {self.worst_step}{spread}{gaps}; plot {self.plot}"
        )


def compare_runs(
    run_a: str | Path,
    run_b: str | Path,
    profile: str = DEFAULT_PROFILE,
    steps: int | None = None,
    metric: str | None = None,
    output_dir: str | Path | None = None,
    seed_runs: Sequence[str | Path] = (),
) -> Verdict:
    """Judge run B against run A on `metric` (default: the profile's) over their first `steps` common steps.

    `steps` defaults to the profile's; runs shorter than that are judged on what they
    have, and the verdict says how many steps that was. A non-finite value in
    either run fails its step. A profile with `seeds` needs that many `seed_runs`: runs of
    A's config with other seeds, covering every judged step.
    """
    tolerance = tolerance_profile(profile)
    metric = metric or tolerance.metric
    if steps is not None and steps < 1:
        raise UserError(f"--steps must be at least 1, got {steps}")
    if len(seed_runs) < tolerance.seeds:
        raise UserError(
            f"profile {profile} judges against the spread between seeds: it needs {tolerance.seeds} run(s) of run A's "
            f"config with other seeds (--seed-run), got {len(seed_runs)}"
        )
    if seed_runs and not tolerance.seeds:
        raise UserError(f"profile {profile} has a fixed band and takes no seed runs; a profile with seeds: sampled")
    requested = steps or tolerance.steps
    values_a = _metric_by_step(run_a, metric)
    values_b = _metric_by_step(run_b, metric)
    first, last = max(min(values_a), min(values_b)), min(max(values_a), max(values_b))
    # every step either run recorded the metric at, within both runs' span: one the other run lacks fails
    common = sorted(step for step in set(values_a) | set(values_b) if first <= step <= last)[:requested]
    if not common:
        raise UserError(f"{run_a} and {run_b} have no step in common with a value of {metric!r}")
    missing = {
        step: [role for role, values in (("A", values_a), ("B", values_b)) if step not in values]
        for step in common
        if step not in values_a or step not in values_b
    }
    a_S = np.array([values_a.get(step, math.nan) for step in common], dtype=float)
    b_S = np.array([values_b.get(step, math.nan) for step in common], dtype=float)
    spread = None
    seeds_RS = np.empty((0, len(common)))
    if seed_runs:
        _check_distinct(run_a, run_b, seed_runs)
        seeds_RS, spread = measured_spread(run_a, seed_runs, metric, common, tolerance.window)
    judged = _judge(a_S, b_S, tolerance, spread)
    steps_S = np.array(common)
    failing_S = steps_S[~judged.ok_S]
    magnitude_S = np.where(np.isfinite(judged.diff_S), np.abs(judged.diff_S), np.inf)

    output = Path(output_dir) if output_dir is not None else metrics_path(run_b).parent
    plot_path = output / f"compare-{metric}.png"
    verdict_path = output / f"compare-{metric}.json"
    verdict = Verdict(
        passed=bool(judged.ok_S.all()),
        profile=profile,
        tolerance=tolerance.model_dump(),
        metric=metric,
        run_a=str(run_a),
        run_b=str(run_b),
        steps_requested=requested,
        steps_compared=len(common),
        first_step=common[0],
        last_step=common[-1],
        max_abs_diff=_finite_or_none(magnitude_S.max()),
        max_rel_diff=_finite_or_none(judged.rel_S.max()),
        worst_step=int(steps_S[np.argmax(magnitude_S)]),
        first_failing_step=int(failing_S[0]) if len(failing_S) else None,
        plot=str(plot_path),
        verdict_file=str(verdict_path),
        seed_runs=[str(run) for run in seed_runs],
        seed_spread=spread,
        max_bound_fraction=_bound_fraction(judged),
        missing_steps={str(step): roles for step, roles in missing.items()},
    )
    _draw(steps_S, a_S, b_S, seeds_RS, judged, verdict, tolerance, plot_path)
    output.mkdir(parents=True, exist_ok=True)
    verdict_path.write_text(json.dumps(verdict.as_dict(), indent=2) + "\n", encoding="utf-8")
    return verdict


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _metric_by_step(run: str | Path, metric: str) -> dict[int, float]:
    records = read_metrics(run)
    values = {
        r["step"]: float(r[metric]) if _is_number(r[metric]) else math.nan  # a recorded non-number fails its step
        for r in records
        if metric in r and _is_number(r.get("step"))
    }
    if not any(_is_number(r.get(metric)) for r in records):
        numeric = sorted({k for r in records for k, v in r.items() if isinstance(v, (int, float)) and k != "step"})
        raise UserError(f"{metrics_path(run)} has no metric {metric!r}; numeric metrics there: {', '.join(numeric)}")
    return values


def measured_spread(
    run_a: str | Path, seed_runs: Sequence[str | Path], metric: str, steps: list[int], window: int
) -> tuple[np.ndarray, float]:
    """The seed runs' values at `steps` and the spread between them and run A (`_seed_spread`).

    Refused, naming the run: one without a finite value at every step (A included: the band is measured on
    its values too), and runs that drew exactly what A drew, which measure no spread."""
    a_S = np.array(_spread_values(run_a, "run A", metric, steps))
    seeds_RS = np.array([_spread_values(run, "seed run", metric, steps) for run in seed_runs])
    spread = _seed_spread(a_S, seeds_RS, window)
    if spread == 0.0:
        raise NoSpread(
            f"the seed runs {', '.join(str(run) for run in seed_runs)} drew the same {metric!r} as {run_a} at every "
            f"step of {steps[0]}..{steps[-1]}: they measure no spread to judge against"
        )
    return seeds_RS, spread


def _spread_values(run: str | Path, role: str, metric: str, steps: list[int]) -> list[float]:
    values = _metric_by_step(run, metric)
    missing = [step for step in steps if step not in values]
    if missing:
        raise UserError(
            f"{role} {run} has no {metric!r} at {len(missing)} of the judged steps (first {missing[0]}, last "
            f"{missing[-1]})"
        )
    broken = [step for step in steps if not math.isfinite(values[step])]
    if broken:
        raise UserError(f"{role} {run} has a non-finite {metric!r} at step {broken[0]}: it measures no spread")
    return [values[step] for step in steps]


def _check_distinct(run_a: str | Path, run_b: str | Path, seed_runs: Sequence[str | Path]) -> None:
    """Seed runs are other runs: a repeated one would add a pair that differs by nothing, and A or B among
    them would judge a run against itself."""
    seen = {metrics_path(run_a).resolve(): "run A", metrics_path(run_b).resolve(): "run B"}
    for run in seed_runs:
        path = metrics_path(run).resolve()
        if path in seen:
            raise UserError(f"seed run {run} is {seen[path]} again: a seed run must be a run of its own")
        seen[path] = "another seed run"


def _full_window_scale(steps: int, window: int) -> np.ndarray:
    """How much wider the noise of a trailing mean is at each step than over a full window: the first
    `window - 1` means average fewer steps (sqrt(window / steps averaged), for independent steps)."""
    return np.sqrt(window / np.minimum(np.arange(1, steps + 1), window))


def _seed_spread(a_S: np.ndarray, seeds_RS: np.ndarray, window: int) -> float:
    """The RMS over every pair of {run A, seed runs} and every step of their trailing means' difference,
    each scaled to a full window's noise: how far apart runs that differ only in their draws lie."""
    scale_S = _full_window_scale(len(a_S), window)
    means = [_trailing_mean(values_S, window) for values_S in (a_S, *seeds_RS)]
    scaled = [(first - second) / scale_S for first, second in combinations(means, 2)]
    return float(np.sqrt(np.mean(np.square(scaled))))


def _trailing_mean(values_S: np.ndarray, window: int) -> np.ndarray:
    """Mean of each step and the `window - 1` before it (fewer at the start); a NaN stays a NaN.

    Summed per window rather than by differences of a running sum, whose rounding
    would hide the one-ulp differences the bitwise profile exists to catch.
    """
    return np.array([values_S[max(0, end - window + 1) : end + 1].mean() for end in range(len(values_S))])


class _Judged(NamedTuple):
    mean_a_S: np.ndarray
    mean_b_S: np.ndarray
    diff_S: np.ndarray
    bound_S: np.ndarray
    rel_S: np.ndarray
    ok_S: np.ndarray


def _judge(a_S: np.ndarray, b_S: np.ndarray, tolerance: ToleranceProfile, spread: float | None) -> _Judged:
    mean_a_S = _trailing_mean(a_S, tolerance.window)
    mean_b_S = _trailing_mean(b_S, tolerance.window)
    with np.errstate(invalid="ignore", divide="ignore"):
        diff_S = mean_b_S - mean_a_S
        bound_S = tolerance.atol + tolerance.rtol * np.abs(mean_a_S)
        if spread is not None:
            bound_S = bound_S + tolerance.spread_z * spread * _full_window_scale(len(a_S), tolerance.window)
        rel_S = np.where(mean_a_S != 0, np.abs(diff_S) / np.abs(mean_a_S), np.where(diff_S == 0, 0.0, np.inf))
        ok_S = np.isfinite(mean_a_S) & np.isfinite(mean_b_S) & (np.abs(diff_S) <= bound_S)
    return _Judged(mean_a_S, mean_b_S, diff_S, bound_S, rel_S, ok_S)


def _bound_fraction(judged: _Judged) -> float | None:
    """The largest share of its bound a step's difference used: the yardstick common to every profile. None
    where it is no finite number: a non-finite value, or a difference against a zero bound (bitwise's)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        fraction_S = np.abs(judged.diff_S) / judged.bound_S
    fraction_S = np.where((judged.diff_S == 0) & (judged.bound_S == 0), 0.0, fraction_S)
    if not np.isfinite(fraction_S).all() or not (judged.bound_S > 0).any():
        return None
    return float(fraction_S.max())


def _finite_or_none(value: float) -> float | None:
    """JSON has no NaN or infinity: a difference involving a non-finite value is written as null."""
    return float(value) if math.isfinite(value) else None


def _draw(
    steps_S, a_S, b_S, seeds_RS, judged: _Judged, verdict: Verdict, tolerance: ToleranceProfile, path: Path
) -> None:
    figure, (curves, difference) = new_figure(rows=2)
    for index, seed_S in enumerate(seeds_RS):
        curves.plot(
            steps_S,
            _trailing_mean(seed_S, tolerance.window),
            color="tab:gray",
            alpha=0.6,
            linewidth=0.8,
            label="A with other seeds" if index == 0 else None,
        )
    curves.plot(steps_S, a_S, color="tab:blue", alpha=0.35, linewidth=0.8)
    curves.plot(steps_S, b_S, color="tab:orange", alpha=0.35, linewidth=0.8)
    curves.plot(steps_S, judged.mean_a_S, color="tab:blue", label=f"A: {verdict.run_a}")
    curves.plot(steps_S, judged.mean_b_S, color="tab:orange", linestyle="--", label=f"B: {verdict.run_b}")
    smoothing = f", trailing mean over {tolerance.window} steps" if tolerance.window > 1 else ""
    outcome = "PASS" if verdict.passed else "FAIL"
    curves.set(ylabel=verdict.metric, title=f"{outcome} — profile {verdict.profile}{smoothing}")
    curves.legend(fontsize="small")
    curves.grid(alpha=0.3)
    bound_S = judged.bound_S
    difference.fill_between(steps_S, -bound_S, bound_S, color="tab:green", alpha=0.2, label="tolerance")
    difference.plot(steps_S, judged.diff_S, color="black", linewidth=1.0, label="B - A")
    if verdict.first_failing_step is not None:
        difference.axvline(verdict.first_failing_step, color="tab:red", linestyle=":", label="first failure")
    difference.set(xlabel="step", ylabel=f"difference in {verdict.metric}")
    difference.legend(fontsize="small")
    difference.grid(alpha=0.3)
    save_figure(figure, path)
