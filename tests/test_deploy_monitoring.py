"""deploy/monitoring: every alert is complete and has its runbook, and every metric an alert
or a dashboard panel names is one fracgpu exports (or an external exporter's, named here)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from certs.metrics import CertsMetrics
from core.informer import InformerMetrics
from deviceplugin.classic.metrics import Metrics as DevicePluginMetrics
from deviceplugin.dra.metrics import DraMetrics
from quota.metrics import QuotaMetrics
from webhook.metrics import AdmissionMetrics

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "deploy" / "monitoring"
GUIDE = ROOT / "docs" / "operator-guide.md"
# Series of other exporters the alerts use: Prometheus itself, kube-state-metrics.
EXTERNAL = {"up", "kube_daemonset_status_number_unavailable"}
_METRIC = re.compile(r"\b(fracgpu_[a-z0-9_]+|up|kube_[a-z0-9_]+)\b(?!\s*\()")


def exported() -> set[str]:
    """Every series name fracgpu's metrics classes expose, as Prometheus names them."""
    registry = CollectorRegistry()
    AdmissionMetrics(registry)
    QuotaMetrics(registry)
    CertsMetrics(registry)
    DevicePluginMetrics(registry).watch_cards(list)
    DraMetrics(registry)
    InformerMetrics(registry)
    names: set[str] = set()
    for family in registry.collect():
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type == "histogram":
            names.update(f"{family.name}_{suffix}" for suffix in ("bucket", "sum", "count"))
        else:
            names.add(family.name)
    return names


def rules() -> list[dict[str, Any]]:
    document = yaml.safe_load((MONITORING / "prometheus-rule.yaml").read_text())
    return [rule for group in document["spec"]["groups"] for rule in group["rules"]]


def panel_exprs() -> list[tuple[str, str]]:
    dashboard = json.loads((MONITORING / "fracgpu-dashboard.json").read_text())
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_alert_has_expr_for_severity_and_a_runbook_section() -> None:
    anchors = {
        slug(line.lstrip("#")) for line in GUIDE.read_text().splitlines() if line.startswith("#")
    }
    for rule in rules():
        assert {"alert", "expr", "for", "labels", "annotations"} <= rule.keys(), rule
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule
        assert rule["annotations"]["summary"], rule
        page, _, anchor = rule["annotations"]["runbook"].partition("#")
        assert page == "docs/operator-guide.md", rule
        assert anchor in anchors, f"{rule['alert']}: no section #{anchor} in the operator guide"


def test_alert_names_are_unique() -> None:
    names = [rule["alert"] for rule in rules()]
    assert len(names) == len(set(names))


@pytest.mark.parametrize(
    ("source", "expr"),
    [pytest.param(r["alert"], r["expr"], id=r["alert"]) for r in rules()]
    + [pytest.param(title, expr, id=f"panel-{title}") for title, expr in panel_exprs()],
)
def test_every_metric_named_is_exported(source: str, expr: str) -> None:
    known = exported() | EXTERNAL
    named = set(_METRIC.findall(expr)) - {"by", "le"}
    assert named, f"{source}: no metric found in {expr!r}"
    assert named <= known, f"{source} names {sorted(named - known)}, which nothing exports"


def test_the_dashboard_is_one_grafana_document() -> None:
    dashboard = json.loads((MONITORING / "fracgpu-dashboard.json").read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "namespace"}
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
