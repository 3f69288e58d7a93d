"""What a rehearsal records and prints: its comparisons, the worst deviation, the ops that ran portable, the summary.

The record is the line appended to the rehearsal history; `ferry report` reads the
same fields, so their names are the history's format.
"""

from __future__ import annotations

import datetime

from ferry.kernels.ledger import load_ledger
from ferry.portability.comparison.compare import Verdict
from ferry.portability.rehearsal.conditions import FAIR, describe_conditions, ratio_fairness


def comparison_record(verdict: Verdict | str) -> dict:
    if isinstance(verdict, str):
        return {"passed": False, "failure": verdict}
    fields = (
        "passed",
        "steps_compared",
        "first_step",
        "last_step",
        "max_abs_diff",
        "max_rel_diff",
        "worst_step",
        "first_failing_step",
        "plot",
        "verdict_file",
        "metric",
        "seed_spread",
        "max_bound_fraction",
    )
    return {name: getattr(verdict, name) for name in fields}


def worst_comparison(comparisons: dict[str, Verdict | str]) -> dict:
    """The comparison that came closest to (or went furthest past) its bound: by the share of the bound used,
    or by relative deviation where a bound is zero (bitwise)."""
    failed = {name: verdict for name, verdict in comparisons.items() if isinstance(verdict, str)}
    if failed:
        name, reason = next(iter(failed.items()))
        return {"comparison": name, "failure": reason}
    by_bound = all(verdict.max_bound_fraction is not None for verdict in comparisons.values())

    def closeness(verdict: Verdict) -> float:
        if verdict.max_abs_diff is None:
            return float("inf")
        measure = verdict.max_bound_fraction if by_bound else verdict.max_rel_diff
        return float("inf") if measure is None else measure

    name, verdict = max(comparisons.items(), key=lambda item: closeness(item[1]))
    return {
        "comparison": name,
        "max_abs_diff": verdict.max_abs_diff,
        "max_rel_diff": verdict.max_rel_diff,
        "max_abs_diff_step": verdict.worst_step,
        "max_bound_fraction": verdict.max_bound_fraction,
    }


def worst_bound_share(record: dict) -> float | None:
    """How much of its tolerance bound a recorded rehearsal's worst comparison used (above 1 is outside): the
    one figure that reads the same under every profile, a band in seed spreads included, where a relative
    deviation means little (a reward near zero). A record from before verdicts measured it is read through its
    relative deviation over the profile's relative tolerance; an exact match uses none of any bound."""
    worst = record.get("worst", {})
    if worst.get("max_bound_fraction") is not None:
        return worst["max_bound_fraction"]
    if worst.get("max_abs_diff") == 0:
        return 0.0
    rtol = record.get("tolerance", {}).get("rtol")
    relative = worst.get("max_rel_diff")
    if relative is None or not rtol:
        return None
    return relative / rtol


def portable_on_target(source_ops: dict, target_ops: dict) -> list[dict]:
    """Ops that run their portable implementation on the target where a vendor one ran on the source,
    or where a vendor implementation available on the target is held back because its ledger entry is
    unmeasured or expired; with the gain the ledger measured for the vendor implementation, where it has one.

    A vendor implementation that was measured and not approved is not listed: the ledger found the
    portable path good enough there."""
    ledger = load_ledger()
    today = datetime.date.today()
    entries = {(entry.op, f"{entry.implementation}@{entry.platform}"): entry for entry in ledger.entries}
    rows = []
    for op, choice in target_ops.items():
        if choice["implementation"] != "portable":
            continue
        on_source = source_ops.get(op, {}).get("implementation", "portable")
        if on_source != "portable":
            entry = entries.get((op, on_source))
            rows.append(
                {
                    "op": op,
                    "why": f"ran {on_source} on the source; here: {choice['reason']}",
                    "vendor_implementation": on_source,
                    "ledger_measured_gain": entry.measured_gain if entry else None,
                }
            )
            continue
        for (name, key), entry in entries.items():
            status = entry.debt_status(today)
            if name == op and status in ("unmeasured", "expired") and f"{key}: ledger entry" in choice["reason"]:
                rows.append(
                    {
                        "op": op,
                        "why": f"{key} is available here, but its ledger entry is {status}",
                        "vendor_implementation": key,
                        "ledger_measured_gain": entry.measured_gain,
                    }
                )
                break
    return rows


def summary_lines(record: dict) -> list[str]:
    """The verdict as the console shows it."""
    lines = [
        f"ferry: rehearsal {record['path']} of {record['config']['name']}: {record['verdict']} under "
        f"{record['profile']} ({record['profile_reason']})"
    ]
    if not record["conclusive"]:
        lines.append(f"  inconclusive: {record['inconclusive_reason']}; `ferry report` does not count it as proof")
    titles = {
        "resumed": f"resumed at step {record['switch_at']} on the target",
        "scratch": "from scratch on the target",
    }
    for name, comparison in record["comparisons"].items():
        if "failure" in comparison:
            lines.append(f"  {titles[name]}: FAIL, {comparison['failure']}")
            continue
        outcome = "pass" if comparison["passed"] else f"FAIL from step {comparison['first_failing_step']}"
        metric = comparison.get("metric", "loss")
        if comparison["max_abs_diff"] is None:
            deviation = f"a non-finite {metric}"
        else:
            relative = comparison["max_rel_diff"]
            deviation = f"max |diff| {comparison['max_abs_diff']:.3g}" + (
                "" if relative is None else f" (relative {relative:.3g})"
            )
        spread = comparison.get("seed_spread")
        band = (
            ""
            if spread is None
            else f"; {metric} judged within {record['tolerance']['spread_z']:g} x the seed spread {spread:.3g}"
        )
        lines.append(
            f"  {titles[name]}: {outcome}, steps {comparison['first_step']}..{comparison['last_step']}, "
            f"{deviation} at step {comparison['worst_step']}{band}"
        )
    carried = record["carried"]
    if carried:
        lines.append("  carried over: " + "; ".join(f"{part}: {state}" for part, state in carried.items()))
    lead = record["lead_time"]
    lines.append(
        "  lead time: bundle check "
        + _seconds(lead["bundle_check_s"])
        + ", checkpoint verify "
        + _seconds(lead["verify_s"])
        + " + restore "
        + _seconds(lead["restore_s"])
        + ", first target step "
        + _seconds(lead["first_step_s"])
        + " and resumed run judged "
        + _seconds(lead["judged_s"])
        + " after the target half began"
    )
    lines += _throughput_lines(record["throughput"])
    portable = record["portable_on_target"]
    lines.append(
        "  portable on the target: "
        + ("; ".join(f"{row['op']} ({row['why']})" for row in portable) if portable else "no op lost a vendor kernel")
    )
    return lines


def _throughput_lines(throughput: dict) -> list[str]:
    """Both sides' throughput and their ratio, each figure with the conditions it was measured under: a ratio
    with a side measured under load is printed as not a fair one (ferry/portability/rehearsal/conditions.py)."""
    ratio = throughput["target_over_source"]
    verdict, why = ratio_fairness(throughput)
    shown = ""
    if ratio:
        shown = f" ({ratio:.2f}x)" if verdict == FAIR else f" ({ratio:.2f}x: not a fair ratio, {why})"
    return [
        f"  throughput: source {_rate(throughput['source_tokens_per_s'])}, target "
        f"{_rate(throughput['target_tokens_per_s'])}{shown}",
        f"    source: {describe_conditions(throughput.get('source_conditions'))}",
        f"    target: {describe_conditions(throughput.get('target_conditions'))}",
    ]


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} s"


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f} tok/s"
