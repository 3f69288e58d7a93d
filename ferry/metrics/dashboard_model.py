"""The parts of a Grafana dashboard as ferry describes it: rows of panels of queries (`dashboard_panels.py` lists
them, `dashboard.py` builds the JSON Grafana reads)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Query:
    """One series of a panel: `metric` with the builder's matchers (and `where`, more label matchers), or `expr`
    with `{SELECT}` where they go; `legend` in Grafana's `{{label}}` form."""

    metric: str
    legend: str
    where: str = ""
    expr: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str  # one of Grafana's units (`none` for ratios and plain numbers)
    queries: tuple[Query, ...]
    kind: str = "timeseries"
    width: int = 8
    height: int = 8


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]
    collapsed: bool = False  # its series appear only in some runs' records
    family: str = "lm"  # the kind of run whose records fill it (a test scrapes one of each)


def series(metric: str, legend: str, **kw: str) -> Query:
    """`ferry_<metric>`, one series a run."""
    return Query(f"ferry_{metric}", f"{legend} {{{{run}}}}", **kw)


def per_layer(metric: str, legend: str) -> Query:
    """`ferry_<metric>`, one series a run and MoE layer."""
    return Query(f"ferry_{metric}", f"{legend} layer {{{{layer}}}} {{{{run}}}}")
