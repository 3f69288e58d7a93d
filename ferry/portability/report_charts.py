"""The portability report's charts: switching lead time per path, rehearsal trends, portable overhead per op."""

from __future__ import annotations

import datetime
from pathlib import Path

from matplotlib.ticker import PercentFormatter

from ferry.metrics.plots import new_figure, save_figure
from ferry.portability.rehearsal_record import worst_bound_share


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
        for index, (name, key, color) in enumerate(phases):
            width = row.get(key) or 0.0
            axes.barh(position, width, left=left, color=color, label=name if position == 0 else None)
            left += width
    axes.set_yticks(range(len(rows)), labels)
    axes.invert_yaxis()
    axes.set(xlabel="seconds after the target half began", title="Switching lead time, latest rehearsal per path")
    axes.legend(fontsize="small", loc="lower right")
    axes.grid(axis="x", alpha=0.3)
    return save_figure(figure, path)


def history_chart(records: list[dict], path: Path) -> Path:
    """Per path over time: the worst deviation as a fraction of its bound, and the target/source throughput."""
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
        ratios = [run["throughput"]["target_over_source"] for run in runs]
        throughput.plot(dates, ratios, marker="o", linewidth=1.0, color=line.get_color(), label=name)
    deviation.axhline(1.0, color="tab:red", linestyle=":", label="tolerance bound")
    deviation.set(ylabel="worst |diff| / bound", title="Rehearsal history (o pass, x fail)")
    deviation.legend(fontsize="x-small")
    deviation.grid(alpha=0.3)
    throughput.axhline(1.0, color="black", linewidth=0.6)
    throughput.set(ylabel="target / source tokens/s", xlabel="date")
    throughput.grid(alpha=0.3)
    figure.autofmt_xdate()
    return save_figure(figure, path)


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
