"""`ferry report`: which paths are proven, the lead-time, debt and overhead sections, and a page that opens offline."""

from __future__ import annotations

import datetime
import json
import re
from html.parser import HTMLParser

import pytest

from ferry.cli.main import main
from ferry.portability.comparison.environment import load_environment
from ferry.portability.rehearsal.record import summary_lines
from ferry.portability.report.history import KERNEL_BENCH, REHEARSALS, append_record
from ferry.portability.report.report import write_report

TODAY = datetime.date(2026, 12, 1)


def rehearsal(
    source, target, passed=True, days_ago=1, source_digest=None, target_digest=None, rel=1e-4, conclusive=True
):
    date = datetime.datetime(2026, 12, 1, 12, tzinfo=datetime.UTC) - datetime.timedelta(days=days_ago)
    comparison = {
        "passed": passed,
        "steps_compared": 10,
        "first_step": 11,
        "last_step": 20,
        "max_abs_diff": rel * 5,
        "max_rel_diff": rel,
        "worst_step": 14,
        "first_failing_step": None if passed else 15,
    }
    return {
        "kind": "rehearsal",
        "date": date.isoformat(),
        "path": f"{source} -> {target}",
        "source": {"name": source, "digest": source_digest or _digest(source)},
        "target": {"name": target, "digest": target_digest or _digest(target)},
        "config": {"name": "tiny", "digest": "c0ffee"},
        "steps": 20,
        "switch_at": 10,
        "profile": "cross-accelerator",
        "profile_reason": "the environments differ in run.device",
        "tolerance": {"rtol": 1e-2},
        "verdict": "PASS" if passed else "FAIL",
        "passed": passed,
        "conclusive": conclusive,
        "inconclusive_reason": None if conclusive else "the from-scratch window of 10 steps is shorter than the 50",
        "comparisons": {"resumed": comparison, "scratch": {**comparison, "passed": True}},
        "worst": {"comparison": "resumed", "max_abs_diff": rel * 5, "max_rel_diff": rel, "max_abs_diff_step": 14},
        "carried": {"weights": "carried"},
        "lead_time": {"bundle_check_s": 0.1, "verify_s": 0.2, "restore_s": 0.3, "first_step_s": 2.5, "judged_s": 6.0},
        "throughput": {"source_tokens_per_s": 1000.0, "target_tokens_per_s": 800.0, "target_over_source": 0.8},
        "portable_on_target": [],
    }


def _digest(name):
    try:
        return load_environment(name).digest
    except Exception:
        return "unknown"


BENCH = {
    "kind": "kernel-bench",
    "date": "2026-11-30T10:00:00+00:00",
    "dtype": "float32",
    "device": "cpu (torch.float32)",
    "budget": 0.1,
    "ops": [
        {
            "op": "moe.routed_experts",
            "portable_seconds": 0.7,
            "fastest_vendor": "fused_loop@cpu",
            "portable_loss": 0.38,
            "verdict": "portable loses 38.0% against fused_loop@cpu: over the 10% budget",
            "timings": [],
        },
        {
            "op": "norm.rms",
            "portable_seconds": 0.07,
            "fastest_vendor": None,
            "portable_loss": None,
            "verdict": "no vendor implementation available here",
            "timings": [],
        },
    ],
}


@pytest.fixture
def history(tmp_path):
    folder = tmp_path / "portability"
    for record in (
        rehearsal("cpu", "cpu-bf16-portable", passed=False, days_ago=3),
        rehearsal("cpu", "cpu-bf16-portable", passed=True, days_ago=1),  # the latest counts
        rehearsal("cpu-ep2", "cpu", passed=True, days_ago=2),
        rehearsal("cpu", "h100-numerics", passed=True, days_ago=2),
        rehearsal("h100-numerics", "mi300x-numerics", passed=True, days_ago=120),  # stale
        rehearsal("cpu", "cuda", passed=True, days_ago=5),
        rehearsal("cpu", "cuda", passed=False, days_ago=1, rel=0.05),  # the latest failed
        rehearsal("cpu", "cpu-ep2", passed=True, days_ago=1, target_digest="an older definition"),
        rehearsal("cpu", "mi300x-numerics", passed=True, days_ago=1, conclusive=False),
    ):
        append_record(folder, REHEARSALS, record)
    append_record(folder, KERNEL_BENCH, BENCH)
    return folder


def test_proven_means_latest_passed_fresh_and_unchanged(history, tmp_path):
    write_report(history, tmp_path / "out", today=TODAY)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    status = {(row["source"], row["target"]): row for row in report["alternatives"]}
    proven = {path for path, row in status.items() if row["status"] == "proven"}
    assert proven == {("cpu", "cpu-bf16-portable"), ("cpu-ep2", "cpu"), ("cpu", "h100-numerics")}
    assert "freshness window" in status[("h100-numerics", "mi300x-numerics")]["reasons"][0]
    assert "failed" in status[("cpu", "cuda")]["reasons"][0]
    assert "changed since" in status[("cpu", "cpu-ep2")]["reasons"][0]
    assert "proves nothing" in status[("cpu", "mi300x-numerics")]["reasons"][0]
    assert status[("cpu", "cuda")]["last_rehearsed"].startswith("2026-11-30")
    assert status[("cpu-ep2", "cpu")]["evidence"] == f"{REHEARSALS} line 3"
    assert all(set(row) >= {"source", "target", "status", "last_rehearsed"} for row in report["alternatives"])


def test_a_shorter_freshness_window_takes_proof_away(history, tmp_path):
    write_report(history, tmp_path / "out", fresh_days=1, today=TODAY)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    proven = {(row["source"], row["target"]) for row in report["alternatives"] if row["status"] == "proven"}
    assert proven == {("cpu", "cpu-bf16-portable")}


def test_an_environment_never_rehearsed_as_a_target_is_not_an_alternative(tmp_path):
    write_report(tmp_path / "empty", tmp_path / "out", today=TODAY)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    never = {row["target"] for row in report["alternatives"] if row["reasons"] == ["never rehearsed as a target"]}
    assert {"cpu", "cuda", "mi300x-numerics"} <= never
    assert all(row["status"] == "not proven" for row in report["alternatives"])
    assert "No rehearsal recorded yet" in (tmp_path / "out" / "report.md").read_text()


def test_sections_carry_lead_time_debt_rewrite_cost_and_overhead_with_their_sources(history, tmp_path):
    write_report(history, tmp_path / "out", today=TODAY)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    lead = {row["path"]: row for row in report["lead_time"]}
    assert lead["cpu -> cuda"]["judged_s"] == 6.0 and lead["cpu -> cuda"]["checkpoint_s"] == pytest.approx(0.5)
    assert lead["cpu -> cuda"]["startup_s"] == pytest.approx(2.5 - 0.1 - 0.5)
    statuses = {entry["implementation"]: entry["status"] for entry in report["debt"]["entries"]}
    assert statuses["fused_loop@cpu"] == "approved" and statuses["grouped_gemm@cuda"] == "unmeasured"
    assert statuses["padded_bmm@cpu"] == "not approved"
    assert {row["platform"] for row in report["rewrite_cost"]} >= {"cpu", "cuda", "rocm"}
    assert report["overhead"][0]["evidence"] == f"{KERNEL_BENCH} line 1"
    assert len(report["history"]) == 9
    text = (tmp_path / "out" / "report.md").read_text()
    for heading in (
        "Proven alternatives",
        "Switching lead time",
        "Vendor-code debt",
        "Portability overhead per op",
        "Rehearsal history",
    ):
        assert f"## {heading}" in text
    assert "| cpu (torch.float32) | moe.routed_experts | 700.00 | fused_loop@cpu | 38.0% |" in text
    assert "the portable path loses nothing, for: norm.rms" in text


class _Sources(HTMLParser):
    def __init__(self):
        super().__init__()
        self.sources: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.sources += [value for name, value in attrs if name in ("src", "href") and value]


def test_the_html_is_self_contained_with_its_charts_embedded(history, tmp_path):
    result = write_report(history, tmp_path / "out", today=TODAY)
    page = (tmp_path / "out" / "report.html").read_text()
    parser = _Sources()
    parser.feed(page)
    assert len(parser.sources) == 3 and all(src.startswith("data:image/png;base64,") for src in parser.sources)
    assert not re.search(r"https?://", page)
    charts = [path for path in result.written if path.suffix == ".png"]
    assert sorted(path.name for path in charts) == ["history.png", "lead_time.png", "overhead.png"]
    assert all(path.read_bytes()[:4] == b"\x89PNG" for path in charts)


def test_the_cli_writes_the_report_and_leaves_out_a_damaged_line_saying_so(history, tmp_path, capsys):
    assert main(["report", "--history", str(history), "--out", str(tmp_path / "out")]) == 0
    assert "proven alternative(s)" in capsys.readouterr().out
    lines = (history / REHEARSALS).read_text().splitlines()
    lines[2] = lines[2][:40]  # torn by a crash: the cpu-ep2 -> cpu rehearsal is gone
    (history / REHEARSALS).write_text("\n".join(lines) + "\n")
    assert main(["report", "--history", str(history), "--out", str(tmp_path / "again")]) == 0
    report = json.loads((tmp_path / "again" / "report.json").read_text())
    assert report["damaged_lines"] == {REHEARSALS: [3]}
    assert "Left out: lines 3 of `rehearsals.jsonl`" in (tmp_path / "again" / "report.md").read_text()
    assert ("cpu-ep2", "cpu") not in {(row["source"], row["target"]) for row in report["alternatives"]}


def test_the_latest_rehearsal_is_the_latest_by_date_when_histories_are_concatenated(tmp_path):
    folder = tmp_path / "merged"
    append_record(folder, REHEARSALS, rehearsal("cpu", "cuda", passed=False, days_ago=1))  # from machine B
    append_record(folder, REHEARSALS, rehearsal("cpu", "cuda", passed=True, days_ago=3))  # machine A, older
    write_report(folder, tmp_path / "out", today=TODAY)
    row = next(
        row
        for row in json.loads((tmp_path / "out" / "report.json").read_text())["alternatives"]
        if row["target"] == "cuda"
    )
    assert row["status"] == "not proven" and row["evidence"] == f"{REHEARSALS} line 1"


def test_names_from_the_history_cannot_put_markup_into_the_page(tmp_path):
    folder = tmp_path / "history"
    append_record(folder, REHEARSALS, rehearsal('<img src="http://example.com/x.png">', "cpu"))
    write_report(folder, tmp_path / "out", today=TODAY)
    page = (tmp_path / "out" / "report.html").read_text()
    assert '<img src="http' not in page and "&lt;img" in page


def test_the_tables_and_the_chart_show_the_share_of_the_bound_a_verdict_used(tmp_path):
    """A verdict records the share of its bound it used, which a profile without a relative tolerance (sampled:
    a band in seed spreads) needs; a record from before that is read through its relative tolerance, and an
    exact match used none of a zero (bitwise) bound."""
    from ferry.portability.rehearsal.record import worst_bound_share

    older = rehearsal("cpu-ep2", "cpu", rel=5e-3)
    assert worst_bound_share(older) == pytest.approx(0.5)
    sampled = {
        **older,
        "path": "cpu -> cpu-ep2",
        "source": older["target"],
        "target": older["source"],
        "tolerance": {"rtol": 0.0, "seeds": 2, "spread_z": 4.0},
    }
    assert worst_bound_share(sampled) is None
    sampled["worst"] = {**older["worst"], "max_rel_diff": 0.9, "max_bound_fraction": 0.37}
    assert worst_bound_share(sampled) == 0.37
    exact = {**older, "tolerance": {"rtol": 0.0}, "worst": {**older["worst"], "max_abs_diff": 0.0, "max_rel_diff": 0.0}}
    assert worst_bound_share(exact) == 0.0

    folder = tmp_path / "history"
    append_record(folder, REHEARSALS, older)
    append_record(folder, REHEARSALS, sampled)
    write_report(folder, tmp_path / "out", today=TODAY)
    rows = {row["target"]: row for row in json.loads((tmp_path / "out" / "report.json").read_text())["alternatives"]}
    assert rows["cpu"]["worst_bound_share"] == pytest.approx(0.5) and rows["cpu-ep2"]["worst_bound_share"] == 0.37
    assert rows["cpu-ep2"]["worst_rel_diff"] == 0.9
    text = (tmp_path / "out" / "report.md").read_text()
    assert "| worst deviation / bound |" in text and "relative deviation" not in text
    assert "| PASS under cross-accelerator | 0.37 |" in text and "| PASS under cross-accelerator | 0.5 |" in text


@pytest.mark.parametrize(
    "damage",
    [
        {"passed": "false", "verdict": "FAIL"},  # a truthy string: it would read as proof
        {"passed": True, "verdict": "FAIL"},
        {"source": None},
        {"lead_time": "x"},
        {"throughput": None},
        {"worst": None},
        {"config": "tiny"},
        {"steps": "20"},
        {"date": "yesterday"},
        {"throughput": {"target_over_source": 0.8, "target_conditions": {"under_load": "false"}}},  # truthy
    ],
)
def test_a_history_line_of_the_wrong_shape_is_left_out_named_never_counted(tmp_path, damage, capsys):
    folder = tmp_path / "portability"
    append_record(folder, REHEARSALS, rehearsal("cpu-ep2", "cpu", passed=True))
    append_record(folder, REHEARSALS, {**rehearsal("cpu", "cpu-bf16-portable", passed=True), **damage})
    assert main(["report", "--history", str(folder), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert f"ferry: warning: left out line(s) 2 of {folder / REHEARSALS}" in out
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["damaged_lines"] == {REHEARSALS: [2]}
    proven = {(row["source"], row["target"]) for row in report["alternatives"] if row["status"] == "proven"}
    assert proven == {("cpu-ep2", "cpu")}


def test_a_history_that_is_a_file_is_refused(history, tmp_path, capsys):
    assert main(["report", "--history", str(history / REHEARSALS), "--out", str(tmp_path / "out")]) == 2
    assert "is a file; give the directory that holds rehearsals.jsonl" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


BUSY = {
    "load_1m_mean": 4.1,
    "load_1m_max": 4.7,
    "load_samples": 3,
    "others_busy_cores": 1.6,
    "logical_cores": 2,
    "cpu_model": "AMD EPYC",
    "ranks": 1,
    "torch_threads": 2,
    "under_load": True,
}
AT_REST = {**BUSY, "load_1m_mean": 0.7, "load_1m_max": 0.8, "others_busy_cores": 0.05, "under_load": False}


def measured_under(record, source, target):
    record["throughput"].update(source_conditions=source, target_conditions=target)
    return record


def test_a_ratio_measured_under_load_is_called_unfair_in_the_summary():
    busy = "\n".join(summary_lines(measured_under(rehearsal("cpu-ep2", "cpu"), BUSY, AT_REST)))
    assert (
        "throughput: source 1,000 tok/s, target 800 tok/s (0.80x: not a fair ratio, the source was measured "
        "under load)" in busy
    )
    assert (
        "    source: measured under load: other processes used 1.6 of 2 cores, load average up to 4.7 (AMD EPYC, "
        "1 rank x 2 threads): not a fair figure" in busy
    )
    assert (
        "    target: other processes used 0.1 of 2 cores, load average up to 0.8 (AMD EPYC, 1 rank x 2 threads)" in busy
    )
    at_rest = "\n".join(summary_lines(measured_under(rehearsal("cpu-ep2", "cpu"), AT_REST, AT_REST)))
    assert "throughput: source 1,000 tok/s, target 800 tok/s (0.80x)\n" in at_rest and "fair" not in at_rest
    old = "\n".join(summary_lines(rehearsal("cpu-ep2", "cpu")))  # written before ferry measured the load
    assert "(0.80x: not a fair ratio, the source and the target were measured under unknown load)" in old
    assert "    source: load unknown: recorded before ferry measured it" in old


def test_the_report_marks_a_ratio_measured_under_load_and_reads_older_lines_as_unknown(tmp_path):
    folder = tmp_path / "history"
    append_record(folder, REHEARSALS, measured_under(rehearsal("cpu-ep2", "cpu"), BUSY, AT_REST))
    append_record(folder, REHEARSALS, measured_under(rehearsal("cpu", "cpu-bf16-portable"), AT_REST, AT_REST))
    append_record(folder, REHEARSALS, rehearsal("cpu", "cuda"))  # written before ferry measured the load
    write_report(folder, tmp_path / "out", today=TODAY)
    text = (tmp_path / "out" / "report.md").read_text()
    lead = "| 0.10 s | 0.50 s | 2.50 s | 6.00 s |"
    assert f"| cpu-ep2 -> cpu {lead} 1,000 † | 800 | 0.80 † | - | rehearsals.jsonl line 1 |" in text
    assert f"| cpu -> cpu-bf16-portable {lead} 1,000 | 800 | 0.80 | - | rehearsals.jsonl line 2 |" in text
    assert f"| cpu -> cuda {lead} 1,000 ? | 800 ? | 0.80 ? | - | rehearsals.jsonl line 3 |" in text
    assert (
        "| cpu-ep2 -> cpu | tiny | 20 (10) | **PASS** | cross-accelerator | 0.01 | 2.50 s | 6.00 s | 0.80 † |" in text
    )
    assert "| cpu-ep2 -> cpu | source | 1,000 | AMD EPYC | 2 | 1 x 2 | 4.1 / 4.7 | 1.60 | **under load** † |" in text
    assert "| cpu-ep2 -> cpu | target | 800 | AMD EPYC | 2 | 1 x 2 | 0.7 / 0.8 | 0.05 | at rest |" in text
    assert "| cpu -> cuda | source | 1,000 | - | - | - | - | - | unknown ? |" in text
    assert "† measured under load: while it ran, other processes kept more than 25% of the machine's" in text
    assert "? load unknown: recorded before ferry measured the conditions of a throughput" in text
    history = {row["path"]: row for row in json.loads((tmp_path / "out" / "report.json").read_text())["history"]}
    assert history["cpu-ep2 -> cpu"]["ratio_fairness"] == "under load"
    assert history["cpu -> cpu-bf16-portable"]["ratio_fairness"] == "fair"
    assert history["cpu -> cuda"]["ratio_fairness"] == "unknown"
    assert (tmp_path / "out" / "history.png").is_file()

    at_rest = tmp_path / "at-rest"
    append_record(at_rest, REHEARSALS, measured_under(rehearsal("cpu", "cpu-bf16-portable"), AT_REST, AT_REST))
    write_report(at_rest, tmp_path / "at-rest-out", today=TODAY)
    text = (tmp_path / "at-rest-out" / "report.md").read_text()
    assert "†" not in text and "load unknown" not in text and "| 1,000 | 800 | 0.80 |" in text


def test_the_history_chart_of_one_rehearsal_spans_a_day_either_side_and_draws_an_unfair_ratio_hollow(
    tmp_path, monkeypatch
):
    """matplotlib's own limits for a single date span years (2025 to 2029 for one rehearsal)."""
    from matplotlib import dates as mdates

    from ferry.portability.report import charts as report_charts

    drawn = []
    monkeypatch.setattr(report_charts, "save_figure", lambda figure, path: drawn.append(figure) or path)
    busy = measured_under(rehearsal("cpu-ep2", "cpu"), BUSY, AT_REST)
    report_charts.history_chart([busy], tmp_path / "history.png")
    deviation, throughput = drawn[0].axes
    low, high = throughput.get_xlim()
    assert high - low == pytest.approx(2.0)  # days
    assert mdates.num2date(low) < datetime.datetime.fromisoformat(busy["date"]) < mdates.num2date(high)
    ratios = [line for line in throughput.get_lines() if list(line.get_ydata()) == [0.8]]
    assert len(ratios) == 1 and ratios[0].get_markerfacecolor() == "none" and ratios[0].get_linestyle() == "None"
