"""`ferry cost`'s outputs: a console table, `cost.json`, `cost.md` and two charts ($/1M tokens by
environment; rent against own over utilisation), from records checked to measure the same thing."""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ferry.config import UserError
from ferry.metrics.plots import new_figure, save_figure
from ferry.portability.bench.cost import (
    DEFAULTS_FILE,
    CostInputs,
    check_comparable,
    check_overrides_used,
    cost_inputs,
    cost_record,
    owned_usd_per_million_tokens,
    read_records,
    scaling_view,
)
from ferry.portability.rehearsal.conditions import FAIR, UNDER_LOAD, describe_conditions


@dataclass
class CostResult:
    out: Path
    records: list[dict]
    warnings: list[str] = field(default_factory=list)
    written: list[Path] = field(default_factory=list)


def write_cost(
    paths: list[str],
    out: str | Path,
    *,
    tokens: float | None = None,
    devices: int | None = None,
    prices: list[str] = (),
    own: list[str] = (),
    console: Console | None = None,
) -> CostResult:
    """Cost every record and write the outputs into `out`."""
    if console is None:
        console = Console(highlight=False)
        if not console.is_terminal:  # a log or a pipe: the whole table on one line per record
            console = Console(highlight=False, width=200)
    inputs = cost_inputs(tokens, devices, list(prices), list(own))
    records = read_records(paths)
    check_overrides_used(records, inputs)
    check_comparable(records)
    costed = [cost_record(path, record, inputs) for path, record in records]
    scaling = scaling_view(records)
    warnings = [
        f"WARNING: {row['file']} was measured on a CPU: its throughput and cost say nothing about any accelerator"
        for row in costed
        if row["measured_on_cpu"]
    ] + [_conditions_warning(row) for row in costed if row["measured"] != FAIR]
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {str(out)!r} is a file; name a directory for cost.json, cost.md and the charts")
    out.mkdir(parents=True, exist_ok=True)
    result = CostResult(out, costed, warnings)
    first = records[0][1]
    data = {
        "generated_at": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "suite": first["suite"],
        "suite_digest": first["suite_digest"],
        "input_digest": first["input_digest"],
        "assumptions": inputs.assumptions.model_dump(),
        "sources": inputs.sources,
        "overrides": {
            "rent_usd_per_device_hour": inputs.prices,
            "purchase_price_usd": inputs.purchase,
            "power_kw": inputs.power,
        },
        "records": costed,
        "scaling": scaling,
        "warnings": warnings,
    }
    charts = [
        _cost_chart(costed, out / "usd_per_million_tokens.png"),
        _rent_vs_own_chart(costed, out / "rent_vs_own.png"),
    ]
    (out / "cost.json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    (out / "cost.md").write_text(render_markdown(data, inputs, [chart.name for chart in charts]), encoding="utf-8")
    result.written = [out / "cost.json", out / "cost.md", *charts]
    _print(console, data)
    return result


def _conditions_warning(row: dict) -> str:
    """Why a record's throughput, and every cost from it, may not be the machine's."""
    if row["measured"] == UNDER_LOAD:
        return (
            f"WARNING: {row['file']} was {describe_conditions(row['conditions'])}, nor is any cost from it; measure "
            "it again on a machine at rest"
        )
    return (
        f"WARNING: {row['file']}: whether it was measured under load is unknown "
        f"({describe_conditions(row['conditions'])}); its throughput and costs may not be the machine's"
    )


def _print(console: Console, data: dict) -> None:
    for warning in data["warnings"]:
        console.print(f"[bold red]{escape(warning)}[/]")
    assumptions = data["assumptions"]
    table = Table(title=f"{data['suite']}: {assumptions['tokens']:.3g} tokens on {assumptions['devices']} devices")
    for column in (
        "record",
        "tok/s/device",
        "$/h rent",
        "$/1M rent",
        "$/1M own",
        "break-even util.",
        "days",
        "rent total $",
        "own total $",
    ):
        table.add_column(column, justify="left" if column == "record" else "right")
    for row in data["records"]:
        table.add_row(
            escape(row["label"]),
            f"{row['tokens_per_s_per_device']:,.0f}",
            f"{row['rent_usd_per_device_hour']:.2f}",
            f"{row['usd_per_million_tokens_rent']:.4g}",
            f"{row['usd_per_million_tokens_own']:.4g}",
            _utilization(row["breakeven_utilization"]),
            f"{row['days_to_train']:,.1f}",
            f"{row['cost_to_train_rent_usd']:,.0f}",
            f"{row['cost_to_train_own_usd']:,.0f}",
        )
    console.print(table)
    if data["scaling"]:
        _print_scaling(console, data["scaling"])


def _print_scaling(console: Console, scaling: list[dict]) -> None:
    """The scaling view as cost.md has it: the flag alone would say that communication dominates somewhere,
    not how throughput per device fell on the way there."""
    table = Table(title="Scaling: throughput per device and communication by layout")
    for column in ("device", "world size", "EP", "tok/s/device", "vs smallest", "comm/compute", "comm share", ""):
        table.add_column(column, justify="left" if column in ("device", "") else "right")
    for row in scaling:
        table.add_row(
            escape(row["device"]),
            str(row["world_size"]),
            str(row["ep_degree"]),
            f"{row['tokens_per_s_per_device']:,.0f}",
            f"{row['per_device_vs_smallest']:.2f}",
            _ratio(row["comm_compute_ratio"]),
            _ratio(row["comm_share_of_step"]),
            "[bold yellow]communication dominates[/]" if row["communication_dominates"] else "",
        )
    console.print(table)


def render_markdown(data: dict, inputs: CostInputs, charts: list[str]) -> str:
    """cost.md: the table, the assumptions with their sources, the scaling view and the charts."""
    assumptions = data["assumptions"]
    out = [
        f"# Cost of {data['suite']}",
        "",
        f"Generated {data['generated_at']} from {len(data['records'])} `ferry bench` record(s) of suite "
        f"`{data['suite']}` (definition {data['suite_digest'][:12]}, inputs {data['input_digest'][:12]}): "
        f"{assumptions['tokens']:.3g} tokens on {assumptions['devices']} devices.",
        "",
        *[f"**{warning}**" for warning in data["warnings"]],
        "",
        "| record | tokens/s per device | rent $/device-hour | $/1M tokens rented | $/1M tokens owned | "
        "break-even utilisation | days to train | rented total $ | owned total $ |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in data["records"]:
        out.append(
            f"| {_cell(row['label'])} | {row['tokens_per_s_per_device']:,.0f} | "
            f"{row['rent_usd_per_device_hour']:.2f} | "
            f"{row['usd_per_million_tokens_rent']:.4g} | {row['usd_per_million_tokens_own']:.4g} | "
            f"{_utilization(row['breakeven_utilization'])} | {row['days_to_train']:,.1f} | "
            f"{row['cost_to_train_rent_usd']:,.0f} | {row['cost_to_train_own_usd']:,.0f} |"
        )
    out += [
        "",
        *(f"![{name}]({name})" for name in charts),
        "",
        "## Assumptions",
        "",
        "| assumption | value | source |",
        "| --- | ---: | --- |",
    ]
    for key, value in assumptions.items():
        out.append(f"| {key} | {value:g} | {' '.join(inputs.sources[key].split())} |")
    out += [
        "",
        f"Defaults from `{DEFAULTS_FILE.name}` (`ferry/portability/`); rent from each record (the hardware "
        "profile's price when it was measured), purchase price and power per device from the hardware profiles "
        "(`ferry/platform/profiles/<profile>.yaml`, each figure with its source there), unless given with "
        "`--price` or `--own`. Owned costs count the device and its share of the server, "
        "depreciated straight-line, and the energy it draws at full load while training (idle power, staff, "
        "network and buildings are not counted). Time to train assumes the measured rate per device holds "
        "at the number of devices given.",
    ]
    if data["scaling"]:
        out += [
            "",
            "## Scaling",
            "",
            "| device | world size | EP degree | tokens/s per device | vs the smallest layout | comm/compute | "
            "communication share of the step | |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for row in data["scaling"]:
            flag = "**communication dominates**" if row["communication_dominates"] else ""
            out.append(
                f"| {row['device']} | {row['world_size']} | {row['ep_degree']} | {row['tokens_per_s_per_device']:,.0f} "
                f"| {row['per_device_vs_smallest']:.2f} | {_ratio(row['comm_compute_ratio'])} | "
                f"{_ratio(row['comm_share_of_step'])} | {flag} |"
            )
    return "\n".join(out) + "\n"


def _cost_chart(costed: list[dict], path: Path) -> Path:
    figure, (axes,) = new_figure(rows=1, width=9.0, row_height=1.4 + 0.6 * len(costed))
    positions = np.arange(len(costed))
    axes.barh(positions - 0.2, [row["usd_per_million_tokens_rent"] for row in costed], height=0.4, label="rented")
    axes.barh(positions + 0.2, [row["usd_per_million_tokens_own"] for row in costed], height=0.4, label="owned")
    axes.set_yticks(positions, [row["label"] for row in costed], fontsize="small")
    axes.invert_yaxis()
    axes.set(xlabel="$ per million tokens", title="Cost per million tokens by environment")
    axes.legend(fontsize="small")
    axes.grid(axis="x", alpha=0.3)
    return save_figure(figure, path)


def _rent_vs_own_chart(costed: list[dict], path: Path) -> Path:
    figure, (axes,) = new_figure(rows=1, width=9.0, row_height=4.5)
    utilization = np.linspace(0.05, 1.0, 96)
    for row in costed:
        owned = [owned_usd_per_million_tokens(row, u) for u in utilization]
        line = axes.plot(utilization, owned, label=f"{row['label']}: owned")[0]
        axes.axhline(
            row["usd_per_million_tokens_rent"], color=line.get_color(), linestyle="--", label=f"{row['label']}: rented"
        )
        breakeven = row["breakeven_utilization"]
        if breakeven is not None and breakeven <= 1.0:
            axes.plot([breakeven], [row["usd_per_million_tokens_rent"]], marker="o", color=line.get_color())
    axes.set_yscale("log")
    axes.set(
        xlabel="utilisation of owned devices",
        ylabel="$ per million tokens",
        title="Rent against own (dots: break-even utilisation)",
    )
    axes.legend(fontsize="x-small")
    axes.grid(alpha=0.3)
    return save_figure(figure, path)


def _utilization(value: float | None) -> str:
    if value is None:
        return "never (energy costs more than rent)"
    return f"{value:.0%}" if value <= 1.0 else f"never ({value:.0%} needed)"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")
