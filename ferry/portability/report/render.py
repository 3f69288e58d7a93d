"""The portability report as text: `report.md` from the report's data, and `report.html` from that markdown
with its charts inlined, so the two pages never say different things and the HTML opens without a network."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import markdown

from ferry.portability.rehearsal.conditions import FAIR, UNDER_LOAD, UNDER_LOAD_CORES_SHARE, UNKNOWN, fairness
from ferry.portability.report.history import KERNEL_BENCH, REHEARSALS

_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 70rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
table { border-collapse: collapse; margin: 0.8rem 0; font-size: 0.9rem; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.5rem; text-align: left; vertical-align: top; }
th { background: #f0f0f0; }
img { max-width: 100%; border: 1px solid #ddd; }
code { background: #f5f5f5; padding: 0 0.2rem; }
"""


def render_markdown(data: dict, history_dir: Path) -> str:
    """The report's data (as in report.json) as markdown, each figure beside the evidence it came from."""
    code = data["ferry"]
    commit = (code.get("git_commit") or "unknown")[:12]
    out = [
        "# Portability report",
        "",
        f"Generated {data['generated_at']} from `{_cell(history_dir)}` by ferry {code['ferry']} (commit {commit}). "
        f"Every figure names its evidence: a line of `{REHEARSALS}` or `{KERNEL_BENCH}` in that directory, "
        f"the debt ledger, or the kernel boundary.",
        "",
        *(
            f"**Left out: lines {', '.join(map(str, lines))} of `{name}` are not readable records (torn by a crash "
            "or edited by hand).**\n"
            for name, lines in data["damaged_lines"].items()
        ),
        "## Proven alternatives",
        "",
        f"A move from one environment to another is proven when its latest rehearsal (`ferry rehearse`) passed "
        f"within the last {data['freshness_days']} days and neither environment's definition has changed since: "
        "the run was trained on the source, checkpointed in its own sharding, resumed on the target with its "
        "optimizer state, and continued within a tolerance fixed before it ran. Anything else is not an "
        "alternative, whatever its documentation says.",
        "",
        "| source | target | status | last rehearsed | verdict | worst deviation / bound | why not | evidence |",
        "| --- | --- | --- | --- | --- | ---: | --- | --- |",
    ]
    for row in data["alternatives"]:
        given = " (given with --profile)" if row["profile_given"] else ""
        verdict = f"{row['verdict']} under {row['profile']}{given}" if row["verdict"] else "-"
        out.append(
            f"| {_cell(row['source'] or 'any')} | {_cell(row['target'])} | **{row['status']}** | "
            f"{_date(row['last_rehearsed'])} | {verdict} | {_number(row['worst_bound_share'], '.2g')} | "
            f"{_cell('; '.join(row['reasons']) or '-')} | {_cell(row['evidence'])} |"
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
            source_mark = _MARKS[fairness(row.get("source_conditions"))]
            target_mark = _MARKS[fairness(row.get("target_conditions"))]
            out.append(
                f"| {_cell(row['path'])} | {_seconds(row.get('bundle_check_s'))} | {_seconds(row['checkpoint_s'])} | "
                f"{_seconds(row.get('first_step_s'))} | {_seconds(row.get('judged_s'))} | "
                f"{_number(row.get('source_tokens_per_s'), ',.0f')}{source_mark} | "
                f"{_number(row.get('target_tokens_per_s'), ',.0f')}{target_mark} | "
                f"{_number(row.get('target_over_source'), '.2f')}{_MARKS[row['ratio_fairness']]} | {_cell(portable)} | "
                f"{row['evidence']} |"
            )
        out += _footnotes(
            [fairness(row.get(f"{side}_conditions")) for row in data["lead_time"] for side in ("source", "target")]
        )
        out += [
            "",
            "The conditions each throughput figure was measured under, over the whole run: the cores other "
            "processes kept busy on average (the judge: more than "
            f"{UNDER_LOAD_CORES_SHARE:.0%} of the logical cores is under load) and the 1-minute load average "
            "(for reading only: it lags a run of seconds by a minute).",
            "",
            "| path | side | tok/s | CPU | logical cores | ranks x torch threads | load average mean / max | "
            "cores other processes used | measured | evidence |",
            "| --- | --- | ---: | --- | ---: | --- | --- | ---: | --- | --- |",
        ]
        for row in data["lead_time"]:
            for side in ("source", "target"):
                out.append(_conditions_row(row, side))
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
        *(
            f"| {row['platform']} | {row['vendor_implementations']} | {row['code_lines']} |"
            for row in data["rewrite_cost"]
        ),
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
                    f"| {_cell(bench['device'])} | {op['op']} | {op['portable_seconds'] * 1e3:.2f} | "
                    f"{op['fastest_vendor'] or '-'} | {_number(op['portable_loss'], '.1%')} | {op['verdict']} | "
                    f"{_date(bench['date'])} | {bench['evidence']} |"
                )
        for device, ops in without.items():
            out += [
                "",
                f"On {device} no vendor implementation was measured, so the portable path loses nothing, "
                f"for: {', '.join(ops)}.",
            ]
    else:
        out.append(
            f"No `ferry kernels bench` figures in `{history_dir}` yet, so no `overhead.png`: run `ferry kernels bench` "
            "on each device."
        )
    out += ["", "## Rehearsal history", ""]
    if data["history"]:
        out += [
            "Every rehearsal ever recorded, oldest first; the chart shows each path's worst deviation as a "
            "fraction of its tolerance bound (above 1 fails) and its target/source throughput over time, a ratio "
            "not measured at rest hollow and off the line.",
            "",
            f"![Rehearsal history]({data['charts']['history']})",
            "",
            "| date | path | config | steps (switch) | verdict | profile | worst deviation / bound | "
            "first step | judged | target/source | evidence |",
            "| --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
        ]
        for row in data["history"]:
            out.append(
                f"| {_date(row['date'])} | {_cell(row['path'])} | {_cell(row['config'])} | "
                f"{row['steps']} ({row['switch_at']}) | "
                f"**{row['verdict']}** | {row['profile']} | {_number(row['worst_bound_share'], '.2g')} | "
                f"{_seconds(row['first_step_s'])} | {_seconds(row['judged_s'])} | "
                f"{_number(row['target_over_source'], '.2f')}{_MARKS[row['ratio_fairness']]} | {row['evidence']} |"
            )
        out += _footnotes([row["ratio_fairness"] for row in data["history"]])
    else:
        out.append("No rehearsal recorded yet.")
    return "\n".join(out) + "\n"


_MARKS = {FAIR: "", UNDER_LOAD: " †", UNKNOWN: " ?"}
_FOOTNOTES = {
    UNDER_LOAD: "† measured under load: while it ran, other processes kept more than "
    f"{UNDER_LOAD_CORES_SHARE:.0%} of the machine's logical cores busy, so the figure (and a ratio with it) is "
    "not the machine's and not a fair figure; the history chart shows such a ratio hollow, off its trend line.",
    UNKNOWN: "? load unknown: recorded before ferry measured the conditions of a throughput, or where other "
    "processes' CPU use cannot be read; the history chart shows such a ratio hollow, off its trend line.",
}


def _footnotes(verdicts: list[str]) -> list[str]:
    """The footnotes of the marks a table used, in a fixed order."""
    used = [verdict for verdict in (UNDER_LOAD, UNKNOWN) if verdict in verdicts]
    return [line for verdict in used for line in ("", _FOOTNOTES[verdict])]


def _conditions_row(row: dict, side: str) -> str:
    conditions = row.get(f"{side}_conditions") or {}
    verdict = fairness(conditions)
    mean, peak = conditions.get("load_1m_mean"), conditions.get("load_1m_max")
    load = "-" if peak is None else f"{_number(mean, '.1f')} / {peak:.1f}"
    threads = f"{conditions.get('ranks') or '?'} x {conditions.get('torch_threads') or '?'}" if conditions else "-"
    measured = {FAIR: "at rest", UNDER_LOAD: "**under load** †", UNKNOWN: "unknown ?"}[verdict]
    return (
        f"| {_cell(row['path'])} | {side} | {_number(row.get(f'{side}_tokens_per_s'), ',.0f')} | "
        f"{_cell(conditions.get('cpu_model') or '-')} | {conditions.get('logical_cores') or '-'} | {threads} | "
        f"{load} | {_number(conditions.get('others_busy_cores'), '.2f')} | {measured} | {row['evidence']} |"
    )


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


def _date(value: str | None) -> str:
    return value[:10] if value else "never"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _number(value: float | None, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def _cell(value) -> str:
    """Text from a history file (environment, config and path names) as inert markdown: HTML escaped, so a
    name cannot put markup or a remote reference into the page, and table bars escaped."""
    return str(value).replace("&", "&amp;").replace("<", "&lt;").replace("|", "\\|")
