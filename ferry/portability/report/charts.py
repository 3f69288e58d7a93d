"""The portability report's charts: switching lead time per path, rehearsal trends, portable overhead per op."""

from __future__ import annotations

import datetime
from pathlib import Path

from matplotlib import dates as mdates
from matplotlib.ticker import PercentFormatter

from ferry.metrics.plots import new_figure, save_figure
from ferry.portability.rehearsal.conditions import FAIR, ratio_fairness
from ferry.portability.rehearsal.record import worst_bound_share


def lead_time_chart(rows: list[dict], path: Path) -> Path:
    """One horizontal bar per path, split into the phases of its latest switch."""
    figure, (axes,) = new_figure(rows=1, width=9.0, row_height=1.2 + 0.55 * len(rows))
    phases = (
        ("bundle check", "bundle_check_s", "tab:gray"),
        ("checkpoint verify + restore", "checkpoint_s", "tab:orange"),
        ("start-up to first step", "startup_s", "tab:blue"),
        ("training until judged", "training_s", "tab:green"),
    )
    labels = [row["path"] for row in rows]
    for position, row in enumerate(rows):
        left = 0.0
        for name, key, color in phases:
            width = row.get(key) or 0.0
            axes.barh(position, width, left=left, color=color, label=name if position == 0 else None)
            left += width
    axes.set_yticks(range(len(rows)), labels)
    axes.invert_yaxis()
    axes.set(xlabel="seconds after the target half began", title="Switching lead time, latest rehearsal per path")
    figure.legend(loc="outside lower center", ncols=len(phases), fontsize="small")  # below the bars, never on one
    axes.grid(axis="x", alpha=0.3)
    return save_figure(figure, path)


def history_chart(records: list[dict], path: Path) -> Path:
    """Per path over time: the worst deviation as a fraction of its bound, and the target/source throughput.

    A ratio measured under load, or under load not recorded, is drawn hollow and left off the path's line: the
    line is the trend of fair figures only (ferry/portability/rehearsal/conditions.py)."""
    figure, (deviation, throughput) = new_figure(rows=2, width=9.0, row_height=3.0)
    by_path: dict[str, list[dict]] = {}
    for record in records:
        by_path.setdefault(record["path"], []).append(record)
    for name, runs in by_path.items():
        dates = [datetime.datetime.fromisoformat(run["date"]) for run in runs]
        used = [worst_bound_share(run) for run in runs]
        markers = ["o" if run["passed"] else "x" for run in runs]
        line = deviation.plot(dates, used, linewidth=1.0, label=name)[0]
        for date, value, marker in zip(dates, used, markers):
            deviation.plot([date], [value], marker=marker, color=line.get_color(), linestyle="none")
        ratios = [
            (date, run["throughput"]["target_over_source"], ratio_fairness(run["throughput"])[0])
            for date, run in zip(dates, runs)
        ]
        fair = [(date, ratio) for date, ratio, verdict in ratios if verdict == FAIR]
        unfair = [(date, ratio) for date, ratio, verdict in ratios if verdict != FAIR]
        if fair:
            throughput.plot(*zip(*fair), marker="o", linewidth=1.0, color=line.get_color())
        if unfair:
            throughput.plot(*zip(*unfair), marker="o", markerfacecolor="none", linestyle="none", color=line.get_color())
    deviation.axhline(1.0, color="tab:red", linestyle=":", label="tolerance bound")
    deviation.set(ylabel="worst |diff| / bound", title="Rehearsal history (o pass, x fail)")
    deviation.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside, never on a line
    deviation.grid(alpha=0.3)
    throughput.axhline(1.0, color="black", linewidth=0.6)
    hollow = "measured under load or unknown load:\nnot a fair ratio"
    throughput.plot([], [], marker="o", markerfacecolor="none", linestyle="none", color="gray", label=hollow)
    throughput.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    throughput.set(ylabel="target / source tokens/s", xlabel="date")
    throughput.grid(alpha=0.3)
    _date_axis(throughput, [datetime.datetime.fromisoformat(record["date"]) for record in records])
    return save_figure(figure, path)


def _date_axis(axes, dates: list[datetime.datetime]) -> None:
    """Dates as dates, over at least a day either side of the rehearsals: matplotlib's own limits for a single
    date span years (2025 to 2029 for one rehearsal), which reads as a history that is not there."""
    margin = max((max(dates) - min(dates)) * 0.05, datetime.timedelta(days=1))
    axes.set_xlim(min(dates) - margin, max(dates) + margin)
    locator = mdates.AutoDateLocator()
    axes.xaxis.set_major_locator(locator)
    axes.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))


def overhead_chart(benches: list[dict], path: Path) -> Path:
    """Throughput the portable path loses per op against the fastest vendor implementation, with the budget."""
    figure, axes_list = new_figure(rows=len(benches), width=9.0, row_height=2.8)
    for axes, bench in zip(axes_list, benches):
        ops = [op for op in bench["ops"] if op["portable_loss"] is not None]
        names = [f"{op['op']} vs {op['fastest_vendor']}" for op in ops]
        losses = [op["portable_loss"] for op in ops]
        colors = ["tab:red" if loss > bench["budget"] else "tab:green" for loss in losses]
        axes.barh(range(len(ops)), losses, color=colors)
        axes.set_yticks(range(len(ops)), names, fontsize="small")
        axes.axvline(bench["budget"], color="black", linestyle=":", label=f"budget {bench['budget']:.0%}")
        axes.set(title=f"{bench['device']}, measured {bench['date'][:10]}", xlabel="throughput the portable path loses")
        axes.xaxis.set_major_formatter(PercentFormatter(1.0))
        axes.legend(fontsize="small")
        axes.grid(axis="x", alpha=0.3)
    return save_figure(figure, path)
