"""`ferry report`: the rehearsal history turned into the document a procurement team negotiates with.

It answers, with the evidence for each figure: which moves are proven (a passing
rehearsal within the freshness window, of environments that have not changed since),
how long a switch takes, how much vendor-specific code the stack carries and what it
would cost to rewrite, and what running portable costs per op. It is written as
`report.md`, `report.json` and `report.html` (self-contained: styles inline, charts
embedded, no network), with the charts as PNG files beside them.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field
from pathlib import Path

from ferry.kernels.boundary import rewrite_cost
from ferry.kernels.ledger import LEDGER_PATH, load_ledger
from ferry.platform.fingerprint import code_version
from ferry.portability.comparison.environment import known_environments, load_environment
from ferry.portability.rehearsal.conditions import ratio_fairness
from ferry.portability.rehearsal.record import worst_bound_share
from ferry.portability.report.charts import history_chart, lead_time_chart, overhead_chart
from ferry.portability.report.history import KERNEL_BENCH, REHEARSALS, read_records
from ferry.portability.report.history_shape import KernelBenchShape, RehearsalShape, well_formed
from ferry.portability.report.render import render_html, render_markdown

DEBT_WARNING_DAYS = 30


@dataclass
class ReportResult:
    out: Path
    written: list[Path] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


def write_report(
    history_dir: str | Path, out: str | Path, fresh_days: int = 90, today: datetime.date | None = None
) -> ReportResult:
    """Read the portability directory and write the report into `out`."""
    history_dir, out = Path(history_dir), Path(out)
    today = today or datetime.date.today()
    damaged: dict[str, list[int]] = {REHEARSALS: [], KERNEL_BENCH: []}
    rehearsals = _usable(
        read_records(history_dir, REHEARSALS, damaged[REHEARSALS]), RehearsalShape, damaged[REHEARSALS]
    )
    benches = _usable(
        read_records(history_dir, KERNEL_BENCH, damaged[KERNEL_BENCH]), KernelBenchShape, damaged[KERNEL_BENCH]
    )
    out.mkdir(parents=True, exist_ok=True)
    data = {
        "generated_at": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "history_dir": str(history_dir),
        "damaged_lines": {name: lines for name, lines in damaged.items() if lines},
        "freshness_days": fresh_days,
        "ferry": code_version(),
        "alternatives": alternatives(rehearsals, today, fresh_days),
        "lead_time": lead_times(rehearsals),
        "debt": debt(today),
        "rewrite_cost": [
            {"platform": platform, "vendor_implementations": count, "code_lines": lines}
            for platform, count, lines in rewrite_cost()
        ],
        "overhead": overhead(benches),
        "history": [_history_row(line, record) for line, record in rehearsals],
        "charts": {},
    }
    result = ReportResult(out)
    charts = data["charts"]
    if data["lead_time"]:
        charts["lead_time"] = lead_time_chart(data["lead_time"], out / "lead_time.png").name
    if rehearsals:
        charts["history"] = history_chart([record for _, record in rehearsals], out / "history.png").name
    if data["overhead"]:
        charts["overhead"] = overhead_chart(data["overhead"], out / "overhead.png").name
    text = render_markdown(data, history_dir)
    (out / "report.md").write_text(text, encoding="utf-8")
    (out / "report.json").write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    (out / "report.html").write_text(render_html(text, out), encoding="utf-8")
    result.written = [out / name for name in ("report.md", "report.json", "report.html", *charts.values())]
    proven = [row for row in data["alternatives"] if row["status"] == "proven"]
    result.lines = [
        f"ferry: report of {len(rehearsals)} rehearsal(s) in {history_dir}: {len(proven)} proven alternative(s)"
        + (": " + ", ".join(f"{row['source']} -> {row['target']}" for row in proven) if proven else ""),
        *(
            f"ferry: warning: left out line(s) {', '.join(map(str, lines))} of {history_dir / name}: not JSON, or "
            "not of the shape a rehearsal or kernel bench writes (report.md names them too)"
            for name, lines in data["damaged_lines"].items()
        ),
        *(f"ferry: wrote {path}" for path in result.written),
    ]
    return result


def alternatives(rehearsals: list[tuple[int, dict]], today: datetime.date, fresh_days: int) -> list[dict]:
    """Every rehearsed path with its status, and every known environment never rehearsed as a target.

    A path is `proven` when its latest rehearsal (by date: histories of several machines may be
    concatenated) passed over a window long enough for its tolerance profile, is at most
    `fresh_days` old, and neither environment's definition (where its file is known here) changed since.
    """
    latest: dict[tuple[str, str], tuple[int, dict]] = {}
    for line, record in rehearsals:
        latest[(record["source"]["name"], record["target"]["name"])] = (line, record)
    current = _current_environments()
    rows = []
    for (source, target), (line, record) in latest.items():
        date = datetime.datetime.fromisoformat(record["date"]).date()
        age = (today - date).days
        reasons = []
        if not record["passed"]:
            reasons.append(f"the latest rehearsal failed ({_failure_summary(record)})")
        elif record.get("conclusive") is False:
            reasons.append(f"the latest rehearsal passed but proves nothing: {record.get('inconclusive_reason')}")
        if age > fresh_days:
            reasons.append(f"the latest rehearsal is {age} days old, past the {fresh_days}-day freshness window")
        for side in ("source", "target"):
            name, digest = record[side]["name"], record[side].get("digest")
            if name in current and current[name][0] != digest:
                reasons.append(f"the {side} environment {name!r} has changed since it was rehearsed")
        rows.append(
            {
                "source": source,
                "target": target,
                "status": "not proven" if reasons else "proven",
                "last_rehearsed": record["date"],
                "verdict": record["verdict"],
                "profile": record["profile"],
                "profile_given": str(record.get("profile_reason", "")).startswith("given with --profile"),
                "worst_rel_diff": record.get("worst", {}).get("max_rel_diff"),
                "worst_bound_share": worst_bound_share(record),
                "reasons": reasons,
                "evidence": f"{REHEARSALS} line {line}",
            }
        )
    rehearsed_targets = {target for _, target in latest}
    for name in sorted(set(current) - rehearsed_targets):
        rows.append(
            {
                "source": None,
                "target": name,
                "status": "not proven",
                "last_rehearsed": None,
                "verdict": None,
                "profile": None,
                "profile_given": False,
                "worst_rel_diff": None,
                "worst_bound_share": None,
                "reasons": ["never rehearsed as a target"],
                "evidence": f"{current[name][1]} (no rehearsal)",
            }
        )
    return rows


def lead_times(rehearsals: list[tuple[int, dict]]) -> list[dict]:
    """The switching lead time of each path's latest rehearsal, split into its phases."""
    latest: dict[str, tuple[int, dict]] = {}
    for line, record in rehearsals:
        latest[record["path"]] = (line, record)
    rows = []
    for path, (line, record) in latest.items():
        lead = record["lead_time"]
        checkpoint = (lead.get("verify_s") or 0.0) + (lead.get("restore_s") or 0.0)
        first = lead.get("first_step_s")
        bundle = lead.get("bundle_check_s") or 0.0
        rows.append(
            {
                "path": path,
                "date": record["date"],
                **lead,
                "checkpoint_s": checkpoint,
                "startup_s": None if first is None else max(first - bundle - checkpoint, 0.0),
                "training_s": None if first is None else max(lead["judged_s"] - first, 0.0),
                **record["throughput"],
                **_ratio_fairness(record["throughput"]),
                "portable_on_target": record.get("portable_on_target", []),
                "evidence": f"{REHEARSALS} line {line}",
            }
        )
    return rows


def debt(today: datetime.date) -> dict:
    """The ledger's entries by status today, with the counts."""
    entries = []
    for entry in load_ledger().entries:
        entries.append(
            {
                "op": entry.op,
                "implementation": f"{entry.implementation}@{entry.platform}",
                "status": entry.debt_status(today, DEBT_WARNING_DAYS),
                "owner": entry.owner,
                "approved": str(entry.approved) if entry.approved else None,
                "expires": str(entry.expires),
                "measured_gain": " ".join(entry.measured_gain.split()),
            }
        )
    counts: dict[str, int] = {}
    for entry in entries:
        counts[entry["status"]] = counts.get(entry["status"], 0) + 1
    return {
        "as_of": str(today),
        "warning_days": DEBT_WARNING_DAYS,
        "counts": counts,
        "entries": entries,
        "source": str(LEDGER_PATH.relative_to(LEDGER_PATH.parents[2])),
    }


def overhead(benches: list[tuple[int, dict]]) -> list[dict]:
    """The latest `ferry kernels bench` of each device and dtype, with where it came from."""
    latest: dict[tuple[str, str], tuple[int, dict]] = {}
    for line, record in benches:
        latest[(record["device"], record.get("dtype", ""))] = (line, record)
    return [{**record, "evidence": f"{KERNEL_BENCH} line {line}"} for line, record in latest.values()]


def _usable(records: list[tuple[int, dict]], shape: type, damaged: list[int]) -> list[tuple[int, dict]]:
    """The records of the shape the report reads, oldest first by date; the others join `damaged`."""
    kept = []
    for line, record in records:
        if not well_formed(record, shape):
            damaged.append(line)
            continue
        kept.append((datetime.datetime.fromisoformat(record["date"]).timestamp(), line, record))
    damaged.sort()
    return [(line, record) for _, line, record in sorted(kept, key=lambda item: item[:2])]


def _history_row(line: int, record: dict) -> dict:
    return {
        "date": record["date"],
        "path": record["path"],
        "config": record["config"]["name"],
        "steps": record["steps"],
        "switch_at": record["switch_at"],
        "verdict": record["verdict"],
        "profile": record["profile"],
        "worst_rel_diff": record.get("worst", {}).get("max_rel_diff"),
        "worst_bound_share": worst_bound_share(record),
        "first_step_s": record["lead_time"].get("first_step_s"),
        "judged_s": record["lead_time"].get("judged_s"),
        "target_over_source": record["throughput"].get("target_over_source"),
        **_ratio_fairness(record["throughput"]),
        "evidence": f"{REHEARSALS} line {line}",
    }


def _ratio_fairness(throughput: dict) -> dict:
    verdict, reason = ratio_fairness(throughput)
    return {"ratio_fairness": verdict, "ratio_fairness_reason": reason}


def _current_environments() -> dict[str, tuple[str, Path]]:
    """The digest and file of every environment definition known here, by the name it declares."""
    found = {}
    for path in known_environments().values():
        environment = load_environment(str(path))
        found[environment.name] = (environment.digest, path)
    return found


def _failure_summary(record: dict) -> str:
    worst = record.get("worst", {})
    if "failure" in worst:
        return worst["failure"].splitlines()[0]
    failing = [name for name, comparison in record["comparisons"].items() if not comparison["passed"]]
    return f"{', '.join(failing)} comparison outside {record['profile']}"
