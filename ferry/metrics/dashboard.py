"""The Grafana dashboard, `dashboards/ferry.json`, built from the panel table (`dashboard_panels.py`).

Built rather than edited by hand so that every query carries the same matchers and every panel the same datasource,
as Grafana's dashboard linter asks (its rules are held in `tests/test_dashboard.py`): a templated Prometheus
datasource; `job` and `instance` variables (multi-select, all as `.+`) that every query matches, so one Grafana
tells apart the jobs its Prometheus scrapes; `run` (ferry's run name) and `layer` (the heatmap's MoE layer).

    python -m ferry.metrics.dashboard [PATH]    # writes the dashboard (default: dashboards/ferry.json)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ferry.metrics.dashboard_model import Panel, Query
from ferry.metrics.dashboard_panels import ROWS

DASHBOARD_PATH = Path(__file__).resolve().parent.parent.parent / "dashboards" / "ferry.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
MATCHERS = 'job=~"$job", instance=~"$instance", run=~"$run"'
ROW_WIDTH = 24


def expression(query: Query) -> str:
    """The PromQL of `query`: its metric, or its expression's `{SELECT}`s, with the dashboard's matchers."""
    select = "{" + ", ".join(filter(None, (MATCHERS, query.where))) + "}"
    return query.expr.replace("{SELECT}", select) if query.expr else query.metric + select


def _variable(name: str, label: str, query: str, multi: bool = True) -> dict[str, Any]:
    """A query variable that reloads its values when the time range changes (`refresh: 2`)."""
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": query,
        "definition": query,
        "refresh": 2,
        "multi": multi,
        "includeAll": multi,
        **({"allValue": ".+"} if multi else {}),
        "current": {},
        "hide": 0,
    }


def templating() -> dict[str, Any]:
    return {
        "list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus", "current": {}},
            _variable("job", "Job", "label_values(ferry_step, job)"),
            _variable("instance", "Instance", 'label_values(ferry_step{job=~"$job"}, instance)'),
            _variable("run", "Run", 'label_values(ferry_step{job=~"$job", instance=~"$instance"}, run)'),
            _variable("layer", "MoE layer", f"label_values(ferry_moe_expert_tokens{{{MATCHERS}}}, layer)", multi=False),
        ]
    }


def _panel(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    built: dict[str, Any] = {
        "type": panel.kind,
        "title": panel.title,
        "id": panel_id,
        "datasource": DATASOURCE,
        "description": panel.description,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "targets": [
            {"datasource": DATASOURCE, "expr": expression(query), "legendFormat": query.legend, "refId": chr(65 + i)}
            for i, query in enumerate(panel.queries)
        ],
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
    }
    if panel.kind == "timeseries":
        built["fieldConfig"]["defaults"]["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 0}
        built["options"] = {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}}
    elif panel.kind == "heatmap":
        built["options"] = {
            "calculate": False,
            "yAxis": {"axisPlacement": "left"},
            "color": {"mode": "scheme", "scheme": "Magma", "steps": 64},
            "cellGap": 0,
            "legend": {"show": True},
            "tooltip": {"show": True},
        }
    return built


def build_dashboard() -> dict[str, Any]:
    """The dashboard: each row, then its panels left to right in lines of 24 columns; a collapsed row holds its
    panels inside it, as Grafana keeps them, and takes one line."""
    panels: list[dict[str, Any]] = []
    next_id, y = 1, 0
    for row in ROWS:
        row_panel = {
            "type": "row",
            "title": row.title,
            "id": next_id,
            "collapsed": row.collapsed,
            "gridPos": {"h": 1, "w": ROW_WIDTH, "x": 0, "y": y},
            "panels": [],
        }
        next_id, y = next_id + 1, y + 1
        placed, x, line_height = [], 0, 0
        for panel in row.panels:
            if x + panel.width > ROW_WIDTH:
                x, y, line_height = 0, y + line_height, 0
            placed.append(_panel(panel, next_id, x, y))
            next_id, x, line_height = next_id + 1, x + panel.width, max(line_height, panel.height)
        panels.append(row_panel)
        if row.collapsed:  # its panels lie below it when opened; closed, the next row follows at once
            row_panel["panels"] = placed
            y = row_panel["gridPos"]["y"] + 1
        else:
            panels.extend(placed)
            y += line_height
    return {
        "title": "ferry training",
        "uid": "ferry-training",
        "description": "Per-step metrics of ferry runs (docs/metrics.md names every series).",
        "tags": ["ferry", "moe", "training"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": templating(),
        "panels": panels,
    }


def dashboard_text() -> str:
    return json.dumps(build_dashboard(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> None:
    path = Path(argv[0]) if argv else DASHBOARD_PATH
    path.write_text(dashboard_text(), encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
