"""`ferry report`: the rehearsal history turned into the document a procurement team negotiates with.

It answers, with the evidence for each figure: which moves are proven (a passing
rehearsal within the freshness window, of environments that have not changed since),
how long a switch takes, how much vendor-specific code the stack carries and what it
would cost to rewrite, and what running portable costs per op. It is written as
`report.md`, `report.json` and `report.html` (self-contained: styles inline, charts
embedded, no network), with the charts as PNG files beside them.
"""

from __future__ import annotations

import base64
import datetime
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import markdown

from ferry.kernels.boundary import rewrite_cost
from ferry.kernels.ledger import LEDGER_PATH, load_ledger
from ferry.platform.fingerprint import code_version
from ferry.portability.environment import known_environments, load_environment
from ferry.portability.history import KERNEL_BENCH, REHEARSALS, read_records
from ferry.portability.report_charts import history_chart, lead_time_chart, overhead_chart

DEBT_WARNING_DAYS = 30
_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 70rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
table { border-collapse: collapse; margin: 0.8rem 0; font-size: 0.9rem; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.5rem; text-align: left; vertical-align: top; }
th { background: #f0f0f0; }
img { max-width: 100%; border: 1px solid #ddd; }
code { background: #f5f5f5; padding: 0 0.2rem; }
"""


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
    rehearsals = read_records(history_dir, REHEARSALS)
    benches = read_records(history_dir, KERNEL_BENCH)
    out.mkdir(parents=True, exist_ok=True)
    data = {
        "generated_at": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "history_dir": str(history_dir),
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
        *(f"ferry: wrote {path}" for path in result.written),
    ]
    return result


def alternatives(rehearsals: list[tuple[int, dict]], today: datetime.date, fresh_days: int) -> list[dict]:
    """Every rehearsed path with its status, and every known environment never rehearsed as a target.

    A path is `proven` when its latest rehearsal passed, is at most `fresh_days` old, and
    neither environment's definition (where its file is known here) changed since.
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
        if age > fresh_days:
            reasons.append(f"the latest rehearsal is {age} days old, past the {fresh_days}-day freshness window")
        for side in ("source", "target"):
            name, digest = record[side]["name"], record[side].get("digest")
            if name in current and current[name][0] != digest:
                reasons.append(f"the {side} environment {name!r} has changed since it was rehearsed")
        rows.append({
            "source": source,
            "target": target,
            "status": "not proven" if reasons else "proven",
            "last_rehearsed": record["date"],
            "verdict": record["verdict"],
            "profile": record["profile"],
            "worst_rel_diff": record.get("worst", {}).get("max_rel_diff"),
            "reasons": reasons,
            "evidence": f"{REHEARSALS} line {line}",
        })
    rehearsed_targets = {target for _, target in latest}
    for name in sorted(set(current) - rehearsed_targets):
        rows.append({
            "source": None,
            "target": name,
            "status": "not proven",
            "last_rehearsed": None,
            "verdict": None,
            "profile": None,
            "worst_rel_diff": None,
            "reasons": ["never rehearsed as a target"],
            "evidence": f"{current[name][1]} (no rehearsal)",
        })
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
        rows.append({
            "path": path,
            "date": record["date"],
            **lead,
            "checkpoint_s": checkpoint,
            "startup_s": None if first is None else max(first - bundle - checkpoint, 0.0),
            "training_s": None if first is None else max(lead["judged_s"] - first, 0.0),
            **record["throughput"],
            "portable_on_target": record.get("portable_on_target", []),
            "evidence": f"{REHEARSALS} line {line}",
        })
    return rows


def debt(today: datetime.date) -> dict:
    """The ledger's entries by status today, with the counts."""
    entries = []
    for entry in load_ledger().entries:
        entries.append({
            "op": entry.op,
            "implementation": f"{entry.implementation}@{entry.platform}",
            "status": entry.debt_status(today, DEBT_WARNING_DAYS),
            "owner": entry.owner,
            "approved": str(entry.approved) if entry.approved else None,
            "expires": str(entry.expires),
            "measured_gain": " ".join(entry.measured_gain.split()),
        })
    counts: dict[str, int] = {}
    for entry in entries:
        counts[entry["status"]] = counts.get(entry["status"], 0) + 1
    return {"as_of": str(today), "warning_days": DEBT_WARNING_DAYS, "counts": counts, "entries": entries,
            "source": str(LEDGER_PATH.relative_to(LEDGER_PATH.parents[2]))}


def overhead(benches: list[tuple[int, dict]]) -> list[dict]:
    """The latest `ferry kernels bench` of each device and dtype, with where it came from."""
    latest: dict[tuple[str, str], tuple[int, dict]] = {}
    for line, record in benches:
        latest[(record["device"], record.get("dtype", ""))] = (line, record)
    return [{**record, "evidence": f"{KERNEL_BENCH} line {line}"} for line, record in latest.values()]


def render_markdown(data: dict, history_dir: Path) -> str:
    code = data["ferry"]
    commit = (code.get("git_commit") or "unknown")[:12]
    out = [
        "# Portability report",
        "",
        f"Generated {data['generated_at']} from `{history_dir}` by ferry {code['ferry']} (commit {commit}). "
        f"Every figure names its evidence: a line of `{REHEARSALS}` or `{KERNEL_BENCH}` in that directory, "
        f"the debt ledger, or the kernel boundary.",
        "",
        "## Proven alternatives",
        "",
        f"A move from one environment to another is proven when its latest rehearsal (`ferry rehearse`) passed "
        f"within the last {data['freshness_days']} days and neither environment's definition has changed since: "
        "the run was trained on the source, checkpointed in its own sharding, resumed on the target with its "
        "optimizer state, and continued within a tolerance fixed before it ran. Anything else is not an "
        "alternative, whatever its documentation says.",
        "",
        "| source | target | status | last rehearsed | verdict | worst relative deviation | why not | evidence |",
        "| --- | --- | --- | --- | --- | ---: | --- | --- |",
    ]
    for row in data["alternatives"]:
        verdict = f"{row['verdict']} under {row['profile']}" if row["verdict"] else "-"
        out.append(
            f"| {row['source'] or 'any'} | {row['target']} | **{row['status']}** | {_date(row['last_rehearsed'])} | "
            f"{verdict} | {_number(row['worst_rel_diff'])} | {'; '.join(row['reasons']) or '-'} | {row['evidence']} |"
        )
    if not data["alternatives"]:
        out.append("| - | - | no rehearsal recorded | - | - | - | - | - |")
    out += ["", "## Switching lead time", ""]
    if data["lead_time"]:
        out += [
            "Seconds from the start of the target half (the bundle in hand) of each path's latest rehearsal: "
            "checking the bundle, verifying and restoring the checkpoint, until the first training step on the "
            "target, and until the resumed run was judged against the reference. Throughput is the median "
            "tokens/s of the source's and the target's runs (first step left out).",
            "",
            f"![Switching lead time]({data['charts']['lead_time']})",
            "",
            "| path | bundle check | checkpoint verify + restore | first step | judged | source tok/s | "
            "target tok/s | target/source | ran portable on the target | evidence |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
        ]
        for row in data["lead_time"]:
            portable = "; ".join(f"{item['op']} ({item['why']})" for item in row["portable_on_target"]) or "-"
            out.append(
                f"| {row['path']} | {_seconds(row.get('bundle_check_s'))} | {_seconds(row['checkpoint_s'])} | "
                f"{_seconds(row.get('first_step_s'))} | {_seconds(row.get('judged_s'))} | "
                f"{_number(row.get('source_tokens_per_s'), ',.0f')} | {_number(row.get('target_tokens_per_s'), ',.0f')} | "
                f"{_number(row.get('target_over_source'), '.2f')} | {portable} | {row['evidence']} |"
            )
    else:
        out.append("No rehearsal recorded yet: run `ferry rehearse CONFIG --from ENV --to ENV`.")
    debt_data = data["debt"]
    counts = ", ".join(f"{count} {status}" for status, count in sorted(debt_data["counts"].items()))
    out += [
        "",
        "## Vendor-code debt",
        "",
        f"Every vendor-specific kernel is registered as debt in `{debt_data['source']}` (owner, reason, measured "
        f"gain, approval, expiry). As of {debt_data['as_of']}: {counts}. `expiring` means approved and due for "
        f"review within {debt_data['warning_days']} days; `unmeasured` means registered but never measured; "
        "`not approved` means measured and not worth its upkeep yet.",
        "",
        "| op | implementation | status | approved | expires | measured gain |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for entry in debt_data["entries"]:
        out.append(
            f"| {entry['op']} | {entry['implementation']} | **{entry['status']}** | {entry['approved'] or '-'} | "
            f"{entry['expires']} | {entry['measured_gain']} |"
        )
    out += [
        "",
        "Rewrite cost, from the kernel boundary (`ferry kernels boundary`, docs/boundary.md): the vendor-specific "
        "code that moving one platform's speed to another would rewrite. Dropping it costs no function, only the "
        "speed the ledger records.",
        "",
        "| platform | vendor implementations | vendor-specific code lines |",
        "| --- | ---: | ---: |",
        *(f"| {row['platform']} | {row['vendor_implementations']} | {row['code_lines']} |" for row in data["rewrite_cost"]),
        "",
        "## Portability overhead per op",
        "",
    ]
    if data["overhead"]:
        out += [
            "The throughput each op's portable implementation loses against the fastest vendor implementation "
            "available on the device, from the latest `ferry kernels bench` per device and dtype (forward + "
            "backward on fixed inputs); past the budget an op may take its vendor implementation through the ledger.",
            "",
            f"![Portability overhead per op]({data['charts']['overhead']})",
            "",
            "| device | op | portable ms | fastest vendor | portable loses | verdict | measured | evidence |",
            "| --- | --- | ---: | --- | ---: | --- | --- | --- |",
        ]
        without: dict[str, list[str]] = {}
        for bench in data["overhead"]:
            for op in bench["ops"]:
                if op["fastest_vendor"] is None:
                    without.setdefault(bench["device"], []).append(op["op"])
                    continue
                out.append(
                    f"| {bench['device']} | {op['op']} | {op['portable_seconds'] * 1e3:.2f} | "
                    f"{op['fastest_vendor'] or '-'} | {_number(op['portable_loss'], '.1%')} | {op['verdict']} | "
                    f"{_date(bench['date'])} | {bench['evidence']} |"
                )
        for device, ops in without.items():
            out += ["", f"On {device} no vendor implementation was measured, so the portable path loses nothing, "
                    f"for: {', '.join(ops)}."]
    else:
        out.append(f"No `ferry kernels bench` figures in `{history_dir}` yet: run `ferry kernels bench` on each device.")
    out += ["", "## Rehearsal history", ""]
    if data["history"]:
        out += [
            "Every rehearsal ever recorded, oldest first; the chart shows each path's worst deviation as a "
            "fraction of its tolerance bound (above 1 fails) and its target/source throughput over time.",
            "",
            f"![Rehearsal history]({data['charts']['history']})",
            "",
            "| date | path | config | steps (switch) | verdict | profile | worst relative deviation | "
            "first step | judged | target/source | evidence |",
            "| --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
        ]
        for row in data["history"]:
            out.append(
                f"| {_date(row['date'])} | {row['path']} | {row['config']} | {row['steps']} ({row['switch_at']}) | "
                f"**{row['verdict']}** | {row['profile']} | {_number(row['worst_rel_diff'])} | "
                f"{_seconds(row['first_step_s'])} | {_seconds(row['judged_s'])} | "
                f"{_number(row['target_over_source'], '.2f')} | {row['evidence']} |"
            )
    else:
        out.append("No rehearsal recorded yet.")
    return "\n".join(out) + "\n"


def render_html(text: str, out: Path) -> str:
    """The markdown as one HTML page with its charts inlined as data URIs: it opens with no network."""
    body = markdown.markdown(text, extensions=["tables"])

    def inline(match: re.Match) -> str:
        image = out / match.group(1)
        encoded = base64.b64encode(image.read_bytes()).decode("ascii")
        return f'src="data:image/png;base64,{encoded}"'

    body = re.sub(r'src="([^"/]+\.png)"', inline, body)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>Portability report</title>'
        f"<style>{_STYLE}</style></head><body>\n{body}\n</body></html>\n"
    )


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
        "first_step_s": record["lead_time"].get("first_step_s"),
        "judged_s": record["lead_time"].get("judged_s"),
        "target_over_source": record["throughput"].get("target_over_source"),
        "evidence": f"{REHEARSALS} line {line}",
    }


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


def _date(value: str | None) -> str:
    return value[:10] if value else "never"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _number(value: float | None, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)
