"""deploy/grafana: provisioning that points at the compose services, and a dashboard whose PromQL parses and names real metrics."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy import deployfiles as df
from tests.deploy.deployfiles import promtool

# Panel title -> metrics (sample names) its queries must use; one of each tuple at least.
REQUIRED_PANELS = {
    "Store hit ratio": [("kvpool_store_chunks_total", "kvpool_worker_restored_tokens_total")],
    "Prompt tokens: reused, restored, evaluated": [
        ("kvpool_worker_reused_tokens_total",),
        ("kvpool_worker_restored_tokens_total",),
        ("kvpool_worker_evaluated_tokens_total",),
    ],
    "Time to first token": [("kvpool_gateway_time_to_first_token_seconds_bucket", "kvpool_worker_time_to_first_token_seconds_bucket")],
    "Restore bandwidth": [("kvpool_worker_restore_bytes_total",)],
    "Queue depth": [("kvpool_gateway_queue_depth",)],
    "Worker count": [("up", "kvpool_worker_info")],
}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    found = df.dashboards()
    assert df.DASHBOARDS / "kvpool.json" in found
    return found[df.DASHBOARDS / "kvpool.json"]


def exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in df.panels(dashboard) for t in p.get("targets", []) if t.get("expr")]


@pytest.fixture(scope="module")
def datasource() -> dict[str, Any]:
    doc = yaml.safe_load((df.GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert doc["apiVersion"] == 1
    (ds,) = doc["datasources"]
    return ds


def test_datasource_is_the_compose_prometheus(datasource: dict[str, Any]) -> None:
    services = df.compose()["services"]
    assert datasource["type"] == "prometheus"
    m = re.fullmatch(r"http://([\w.-]+):(\d+)/?", datasource["url"])
    assert m, datasource["url"]
    host, port = m.groups()
    assert host == "prometheus" and host in services
    assert port in {df.parse_port(p)[2] for p in services[host]["ports"]}, f"prometheus does not listen on {port}"


def test_dashboard_provider() -> None:
    doc = yaml.safe_load((df.GRAFANA / "provisioning" / "dashboards" / "kvpool.yml").read_text())
    assert doc["apiVersion"] == 1
    (provider,) = doc["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")


def test_dashboard_structure(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] and dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int)
    panels = df.panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    titles = [p["title"] for p in panels]
    assert len(titles) == len(set(titles)), "panel titles repeat"
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, f"{p['title']} is wider than the grid"
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine
        for t in p.get("targets", []):
            assert t.get("refId") and t.get("expr"), f"{p['title']}: a target without refId or expr"


def test_required_panels(dashboard: dict[str, Any]) -> None:
    by_title = {p["title"]: p for p in df.panels(dashboard)}
    for title, needs in REQUIRED_PANELS.items():
        assert title in by_title, f"the dashboard has no panel {title!r}"
        used = set().union(*(df.promql_metric_names(t["expr"]) for t in by_title[title]["targets"]))
        for alternatives in needs:
            assert used & set(alternatives), f"{title!r} uses none of {alternatives} (it uses {sorted(used)})"
    ttft = " ".join(t["expr"] for t in by_title["Time to first token"]["targets"])
    assert "histogram_quantile(" in ttft and "by (le)" in ttft


def test_every_metric_exists(dashboard: dict[str, Any]) -> None:
    """Every metric a query selects is exported by store/worker/gateway metrics (or is Prometheus' own `up`)."""
    known = df.metric_samples()
    assert {
        "kvpool_gateway_queue_depth",
        "kvpool_store_chunks_total",
        "kvpool_worker_info",
        "kvpool_worker_restore_bytes_total",
        "kvpool_gateway_time_to_first_token_seconds_bucket",
    } <= set(known)
    for title, expr in exprs(dashboard):
        names = df.promql_metric_names(expr)
        assert names, f"{title}: found no metric in {expr}"
        unknown = names - set(known) - {"up"}
        assert not unknown, f"{title}: no such metric {sorted(unknown)} in {expr}"


def test_jobs_exist(dashboard: dict[str, Any]) -> None:
    """job="..." matchers name scrape jobs of prometheus.yml."""
    jobs = {j["job_name"] for j in yaml.safe_load(df.PROMETHEUS_FILE.read_text())["scrape_configs"]}
    for title, expr in exprs(dashboard):
        assert df.promql_label_values(expr, "job") <= jobs, f"{title}: {expr}"


def test_panels_use_the_provisioned_datasource(dashboard: dict[str, Any], datasource: dict[str, Any]) -> None:
    for p in df.panels(dashboard):
        for ds in [p.get("datasource")] + [t.get("datasource") for t in p.get("targets", [])]:
            if ds is not None:
                assert ds == {"type": "prometheus", "uid": datasource["uid"]}, f"{p['title']}: datasource {ds}"


def test_promql_parses(dashboard: dict[str, Any], tmp_path: Path) -> None:
    """promtool parses every query (as a recording rule), Grafana's $__ variables replaced by a duration."""
    rules = [
        {"record": f"kvpool:dashboard:{n}", "expr": df.grafana_variables_to_promql(expr)} for n, (_, expr) in enumerate(exprs(dashboard))
    ]
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = subprocess.run([promtool(), "check", "rules", str(path)], check=False, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, f"promtool rejects a dashboard query:\n{r.stdout}{r.stderr}"
    assert f"{len(rules)} rules found" in r.stdout


def test_promql_parse_check_has_teeth(tmp_path: Path) -> None:
    path = tmp_path / "bad.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [{"record": "a:b", "expr": "sum(rate(x[5m])"}]}]}))
    r = subprocess.run([promtool(), "check", "rules", str(path)], check=False, capture_output=True, text=True, timeout=30)
    assert r.returncode != 0


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            'sum(rate(kvpool_store_chunks_total{result="hit"}[$__rate_interval])) / sum(rate(kvpool_store_chunks_total[5m]))',
            {"kvpool_store_chunks_total"},
        ),
        ("histogram_quantile(0.95, sum by (le) (rate(a_bucket[1m])))", {"a_bucket"}),
        ("sum(rate(x_total[1m])) by (model, layout) > bool 1e-9 offset 5m", {"x_total"}),
        ('count(up{job="worker"} == 1) or vector(0)', {"up"}),
        ("max without (instance) (g) and on(job) h unless ignoring(a) group_left(b) i", {"g", "h", "i"}),
        ('label_replace(m, "dst", "$1", "src", "(.*)")', {"m"}),
    ],
)
def test_promql_metric_names(expr: str, names: set[str]) -> None:
    assert df.promql_metric_names(expr) == names
