"""`ferry plot RUN`: PNGs of a run's metrics.jsonl — loss, throughput, where step time goes, expert load.

Figures are drawn with matplotlib's object API on the Agg canvas, so plotting
needs no display and never changes the global pyplot backend of a caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ferry.metrics.jsonl import metrics_path, read_metrics
from ferry.metrics.names import PLOT_DIR


@dataclass
class PlotResult:
    written: list[Path] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def new_figure(rows: int = 1, width: float = 8.0, row_height: float = 3.2) -> tuple[Figure, list]:
    figure = Figure(figsize=(width, row_height * rows), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    return figure, list(axes)


def save_figure(figure: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


def plot_run(run: str | Path, output_dir: str | Path | None = None) -> PlotResult:
    """Write every plot the run's records allow into `output_dir` (default `<run>/plots`).

    A plot whose metrics the run did not record (an older run, a dense model), or recorded
    with a value it cannot draw (a string, a ragged expert-load row), is skipped with the
    reason, rather than drawn empty or wrong.
    """
    records = read_metrics(run)
    output = Path(output_dir) if output_dir is not None else metrics_path(run).parent / PLOT_DIR
    result = PlotResult()
    for name, needs, draw in (
        ("loss", "loss", _loss),
        ("throughput", "tokens_per_s", _throughput),
        ("time_split", "compute_s", _time_split),
        ("expert_load", "moe.tokens_per_expert", _expert_load),
    ):
        having = [record for record in records if record.get(needs) is not None]
        if not having:
            result.skipped[name] = f"no step of {metrics_path(run)} records {needs!r}"
            continue
        try:
            figure = draw(having)
        except (ValueError, TypeError) as exc:  # a value of the wrong type or shape: edited, or torn by a crash
            result.skipped[name] = f"{metrics_path(run)} holds a value this plot cannot draw ({exc})"
            continue
        result.written.append(save_figure(figure, output / f"{name}.png"))
    return result


def _series(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    having = [record for record in records if record.get(key) is not None]
    return np.array([r["step"] for r in having]), np.array([r[key] for r in having], dtype=float)


def _loss(records: list[dict]) -> Figure:
    figure, (axis,) = new_figure()
    for key in ("loss", "lm_loss"):
        steps, values = _series(records, key)
        if len(steps):
            axis.plot(steps, values, label=key, linewidth=1.2)
    held_out = [record for record in records if record.get("eval.loss")]
    for source in sorted({name for record in held_out for name in record["eval.loss"]}):
        having = [record for record in held_out if source in record["eval.loss"]]
        steps = [record["step"] for record in having]
        axis.plot(steps, [record["eval.loss"][source] for record in having], marker="o", label=f"held-out {source}")
    axis.set(xlabel="step", ylabel="nats", title="loss")
    axis.legend()
    axis.grid(alpha=0.3)
    return figure


def _throughput(records: list[dict]) -> Figure:
    figure, (axis,) = new_figure()
    steps, tokens_per_s = _series(records, "tokens_per_s")
    axis.plot(steps, tokens_per_s, color="tab:blue", linewidth=1.2)
    axis.set(xlabel="step", ylabel="tokens/s (all devices)", title="throughput")
    axis.grid(alpha=0.3)
    steps, mfu = _series(records, "mfu")
    if len(steps):
        mfu_axis = axis.twinx()
        mfu_axis.plot(steps, 100 * mfu, color="tab:orange", linewidth=1.0)
        mfu_axis.set_ylabel("MFU (%)", color="tab:orange")
    return figure


def _time_split(records: list[dict]) -> Figure:
    """Phases stacked on top; below, compute and communication stacked with EP wait as a line.

    EP wait is drawn as a line because it overlaps comm (its all-to-alls are collectives).
    """
    figure, (phases, split) = new_figure(rows=2)
    steps = np.array([r["step"] for r in records])
    bottom = np.zeros(len(records))
    for key in ("forward_s", "backward_s", "optimizer_s"):
        values = np.array([r.get(key) or 0.0 for r in records])
        phases.bar(steps, values, bottom=bottom, width=1.0, label=key)
        bottom += values
    phases.plot(steps, [r["step_s"] for r in records], color="black", linewidth=1.0, label="step_s")
    phases.set(ylabel="s", title="step time by phase")
    phases.legend(loc="upper right", fontsize="small")
    compute = np.array([r.get("compute_s") or 0.0 for r in records])
    comm = np.array([r.get("comm_s") or 0.0 for r in records])
    split.bar(steps, compute, width=1.0, label="compute_s", color="tab:green")
    split.bar(steps, comm, bottom=compute, width=1.0, label="comm_s", color="tab:red")
    split.plot(steps, [r.get("ep_wait_s") or 0.0 for r in records], color="tab:purple", label="ep_wait_s")
    split.set(xlabel="step", ylabel="s", title="compute vs communication")
    split.legend(loc="upper right", fontsize="small")
    return figure


def _expert_load(records: list[dict]) -> Figure:
    """One heatmap per MoE layer: experts down, steps across, colour = load / mean load (1 = even)."""
    counts_SLE = np.array([r["moe.tokens_per_expert"] for r in records], dtype=float)
    steps, layers, experts = counts_SLE.shape
    relative_SLE = counts_SLE / counts_SLE.mean(axis=2, keepdims=True)
    figure, axes = new_figure(rows=layers, row_height=max(1.6, 0.12 * experts + 0.8))
    first, last = records[0]["step"], records[-1]["step"]
    vmax = max(2.0, float(relative_SLE.max()))
    for layer, axis in enumerate(axes):
        image = axis.imshow(
            relative_SLE[:, layer, :].T,
            aspect="auto",
            origin="lower",
            cmap="magma",
            vmin=0.0,
            vmax=vmax,
            extent=(first - 0.5, last + 0.5, -0.5, experts - 0.5),
            interpolation="nearest",
        )
        axis.set(ylabel=f"layer {layer}\nexpert")
        figure.colorbar(image, ax=axis, label="load / mean")
    axes[0].set_title("expert load over steps")
    axes[-1].set_xlabel("step")
    return figure
