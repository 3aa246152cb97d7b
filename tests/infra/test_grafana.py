"""The provisioned Grafana dashboard (infra/grafana/): every panel's PromQL parses (the
``promql-parser`` library, Prometheus's own grammar) and names only series that a running
broker's ``/metrics`` exposes; the provisioning files point at the dashboard."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

from tests.metrics_stack import running_broker

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "infra" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "fleetbroker.json"
# Grafana's interval variables, replaced by a duration before parsing (what Grafana sends)
INTERVALS = re.compile(r"\$(__rate_interval|__interval|__range)\b|\$\{(__rate_interval|"
                       r"__interval|__range)\}")


def panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out += p.get("panels", [])  # a collapsed row holds its panels
    return out


def queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel target and query variable."""
    found = [(p["title"], t["expr"]) for p in panels(dash) for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            # label_values(SERIES, LABEL) is Grafana's, not PromQL: its series is
            m = re.fullmatch(r"label_values\((.+),\s*\w+\)", query)
            found.append((f"variable {var['name']}", m.group(1) if m else query))
    return found


def series(expr: str) -> set[str]:
    """The metric names ``expr`` selects, from its syntax tree."""
    tree = promql_parser.parse(INTERVALS.sub("5m", expr))
    names: set[str] = set()

    def visit(node: Any, *_: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)
        return True

    promql_parser.walk(tree, visit)
    return names


def test_dashboard_queries_name_only_exposed_metrics(tmp_path: Path) -> None:
    dash = json.loads(DASHBOARD.read_text())
    used: dict[str, set[str]] = {}
    for title, expr in queries(dash):
        names = series(expr)
        assert names, f"{title}: {expr} selects no metric"
        for name in names:
            used.setdefault(name, set()).add(title)
    with running_broker(tmp_path) as running:
        exposed = running.scrape().exposed()
    missing = {name: sorted(titles) for name, titles in used.items() if name not in exposed}
    assert not missing, f"panels query series the broker does not expose: {missing}"
    # the panels the operators asked for are there
    for name in ("fleet_cost_usd_total", "fleet_ondemand_cost_usd_total",
                 "fleet_gpu_seconds_total", "fleet_preemptions_total", "fleet_migrations_total",
                 "fleet_open_cost_usd", "fleet_queue_jobs", "fleet_queue_oldest_wait_seconds",
                 "fleet_queue_wait_seconds_bucket",
                 "fleet_scheduling_round_duration_seconds_bucket"):
        assert name in used, name


def test_dashboard_is_well_formed() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"]
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels(dash):
        pos = p["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["targets"], f"{p['title']} has no query"
            assert p["datasource"]["uid"] == "${datasource}"
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "team"} <= names


def test_provisioning_points_at_the_dashboards() -> None:
    provider = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "fleetbroker.yaml").read_text())
    assert provider["apiVersion"] == 1
    (entry,) = provider["providers"]
    assert entry["type"] == "file" and entry["options"]["path"].endswith("/dashboards")
    sources = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    assert [d["type"] for d in sources["datasources"]] == ["prometheus"]


@pytest.mark.parametrize("expr", ["rate(fleet_cost_usd_total[5m]", "sum by team (x)"])
def test_a_broken_query_is_refused(expr: str) -> None:
    """The parser does refuse bad PromQL, so the first test's parse is a real check."""
    with pytest.raises(ValueError):
        series(expr)
