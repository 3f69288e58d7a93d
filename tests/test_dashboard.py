"""The Grafana dashboard: the file is the one `ferry/metrics/dashboard.py` builds, every documented metric is on
it, and it keeps the rules of Grafana's dashboard linter (grafana/dashboard-linter, which cannot be installed here:
its rules are held below, one test each). `tests/test_prometheus_scrape.py` runs its queries on a real Prometheus."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
from conftest import REPO
from prometheus_binaries import binary

from ferry.metrics import prometheus_names
from ferry.metrics.dashboard import DASHBOARD_PATH, build_dashboard, dashboard_text

DASHBOARD = build_dashboard()
VARIABLES = {variable["name"]: variable for variable in DASHBOARD["templating"]["list"]}
# the units the linter accepts that this dashboard may use (Grafana's value formats: misc, data, time, short)
GRAFANA_UNITS = {"none", "short", "percent", "percentunit", "bytes", "decbytes", "s", "ms", "µs", "ns", "Bps"}
SELECTOR = re.compile(r"\b(ferry_\w+)(\{[^}]*\})?")


def panels(dashboard: dict) -> list[dict]:
    """Every panel but the rows, those inside collapsed rows included."""
    found = []
    for panel in dashboard["panels"]:
        found.extend(panel.get("panels", []) if panel["type"] == "row" else [panel])
    return found


def targets(dashboard: dict) -> list[tuple[str, dict]]:
    return [(panel["title"], target) for panel in panels(dashboard) for target in panel["targets"]]


def test_the_file_is_the_built_dashboard():
    assert DASHBOARD_PATH == REPO / "dashboards" / "ferry.json"
    assert DASHBOARD_PATH.read_text(encoding="utf-8") == dashboard_text(), (
        "dashboards/ferry.json is not what ferry/metrics/dashboard_panels.py says: run "
        "`python -m ferry.metrics.dashboard`"
    )


def test_every_documented_metric_is_on_a_panel_and_every_query_names_one():
    queried = {name for _, target in targets(DASHBOARD) for name, _ in SELECTOR.findall(target["expr"])}
    assert queried == prometheus_names(), (
        f"not on the dashboard: {sorted(prometheus_names() - queried)}; unknown: {sorted(queried - prometheus_names())}"
    )
    for variable in VARIABLES.values():
        assert {name for name, _ in SELECTOR.findall(variable.get("query", ""))} <= prometheus_names()


def test_rows_that_only_some_runs_fill_start_collapsed():
    rows = {panel["title"]: panel for panel in DASHBOARD["panels"] if panel["type"] == "row"}
    for title in ("Pipeline", "Context parallelism", "Attention and multi-token prediction", "DPO", "GRPO"):
        assert rows[title]["collapsed"] and rows[title]["panels"], title
    for title in ("Training", "Throughput", "Step time", "Communication", "Mixture of experts", "Reliability"):
        assert not rows[title]["collapsed"] and not rows[title]["panels"], title


def test_template_datasource_rule():
    sources = [variable for variable in VARIABLES.values() if variable["type"] == "datasource"]
    assert len(sources) == 1
    assert (sources[0]["name"], sources[0]["label"], sources[0]["query"]) == ("datasource", "Data source", "prometheus")


@pytest.mark.parametrize("name", ["job", "instance"])
def test_template_job_and_instance_rules(name):
    variable = VARIABLES[name]
    assert variable["datasource"]["uid"] in ("$datasource", "${datasource}")
    assert variable["type"] == "query" and variable["label"] == name.title()
    assert variable["multi"] and variable["allValue"] == ".+"


def test_template_label_promql_and_on_time_change_reload_rules():
    for variable in VARIABLES.values():
        if variable["type"] != "query":
            continue
        assert re.fullmatch(r"label_values\(ferry_\w+(\{[^}]*\})?, \w+\)", variable["query"]), variable["name"]
        assert variable["refresh"] == 2, f"{variable['name']} must reload when the time range changes"


def test_panel_datasource_title_description_units_and_targets_rules():
    for panel in panels(DASHBOARD):
        assert panel["datasource"]["uid"] in ("$datasource", "${datasource}"), panel["title"]
        assert panel["title"].strip() and panel["description"].strip(), panel["title"]
        assert panel["fieldConfig"]["defaults"]["unit"] in GRAFANA_UNITS, panel["title"]
        assert panel["targets"], panel["title"]
        assert all(target["datasource"]["uid"] == "${datasource}" for target in panel["targets"]), panel["title"]


def test_target_job_instance_rate_interval_and_counter_rules():
    for title, target in targets(DASHBOARD):
        expr = target["expr"]
        for name, matchers in SELECTOR.findall(expr):
            assert 'job=~"$job"' in matchers and 'instance=~"$instance"' in matchers, (title, expr)
            assert 'run=~"$run"' in matchers, (title, expr)
            assert not name.endswith("_total") or re.search(rf"(rate|increase)\({name}", expr), (title, expr)
        for window in re.findall(r"\b(?:rate|irate|increase)\([^)]*\[([^\]]+)\]", expr):
            assert window == "$__rate_interval", (title, expr)


def test_target_promql_rule_by_promtool(tmp_path):
    """Every query, its variables given values as Grafana would, parses as PromQL (promtool checks it as a
    recording rule's expression)."""
    promtool = binary("promtool")
    rules = [
        {"record": f"ferry:dashboard_{index}", "expr": substituted(target["expr"])}
        for index, (_, target) in enumerate(targets(DASHBOARD))
    ]
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))  # JSON is YAML
    checked = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules)} rules found" in checked.stdout


def substituted(expr: str, layer: str = "0") -> str:
    """`expr` as Grafana sends it with every multi-select variable at All and the heatmap's layer chosen."""
    for name in ("job", "instance", "run"):
        expr = expr.replace(f"${name}", ".+")
    return expr.replace("$layer", layer).replace("$__rate_interval", "1m")
