"""deploy/monitoring: Prometheus' own promtool checks the alerts and runs their unit tests
(deploy/monitoring/tests/rules-test.yaml), and every alert has a case there that fires it and one
that does not.

promtool reads plain rules files, so the PrometheusRule's ``spec.groups`` is written as
``rules.yaml`` beside a copy of the test file (whose ``rule_files`` names it). ``make promtool``
builds promtool from the module proxy (hack/cluster/modules/promtool); without Go, the tests that
run it skip and say so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "deploy" / "monitoring"
PROMETHEUS_RULE = MONITORING / "prometheus-rule.yaml"
RULES_TEST = MONITORING / "tests" / "rules-test.yaml"
# Where `make promtool` builds it (at the Prometheus version the module pins).
BUILT_PROMTOOL = ROOT / ".build" / "promtool" / "promtool"
# The name the test file's rule_files gives the rules extracted from the PrometheusRule.
RULES_FILE = "rules.yaml"

Obj = dict[str, Any]


def promtool() -> str:
    """The promtool binary: $FRACGPU_PROMTOOL, the one `make promtool` built, or one on PATH."""
    for candidate in (
        os.environ.get("FRACGPU_PROMTOOL"),
        str(BUILT_PROMTOOL),
        shutil.which("promtool"),
    ):
        if candidate and Path(candidate).is_file():
            return candidate
    pytest.skip("no promtool: `make promtool` builds it from the module proxy (needs Go)")


def groups() -> list[Obj]:
    document: Obj = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert document["kind"] == "PrometheusRule"
    found: list[Obj] = document["spec"]["groups"]
    return found


def rules() -> list[Obj]:
    return [rule for group in groups() for rule in group["rules"]]


def unit_tests() -> Obj:
    document: Obj = yaml.safe_load(RULES_TEST.read_text())
    return document


def alert_cases(alertname: str) -> list[Obj]:
    """Every alert_rule_test (of every test group) that evaluates ``alertname``."""
    return [
        case
        for group in unit_tests()["tests"]
        for case in group.get("alert_rule_test") or []
        if case["alertname"] == alertname
    ]


def rule_params(*, alerts_only: bool = False) -> list[Any]:
    """One case per rule of the PrometheusRule, named by its alert (or record: name)."""
    return [
        pytest.param(rule, id=rule.get("alert") or f"record:{rule['record']}")
        for rule in rules()
        if "alert" in rule or not alerts_only
    ]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A directory holding the PrometheusRule's groups as rules.yaml and a copy of the tests."""
    (tmp_path / RULES_FILE).write_text(yaml.safe_dump({"groups": groups()}, sort_keys=False))
    shutil.copy(RULES_TEST, tmp_path / RULES_TEST.name)
    return tmp_path


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(("check", "rules", "--lint-fatal", RULES_FILE), id="check-rules"),
        pytest.param(("test", "rules", RULES_TEST.name), id="test-rules"),
    ],
)
def test_promtool_passes(workdir: Path, args: tuple[str, ...]) -> None:
    proc = subprocess.run(
        [promtool(), *args],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"promtool {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}"


def test_the_unit_tests_read_the_extracted_rules() -> None:
    assert unit_tests()["rule_files"] == [RULES_FILE]


@pytest.mark.parametrize("rule", rule_params())
def test_every_rule_has_a_case_where_it_fires(rule: Obj) -> None:
    if "record" in rule:
        exprs = [
            case["expr"]
            for group in unit_tests()["tests"]
            for case in group.get("promql_expr_test") or []
        ]
        assert any(rule["record"] in expr for expr in exprs), (
            f"recording rule {rule['record']} has no promql_expr_test in {RULES_TEST.name}"
        )
        return
    fires = [case for case in alert_cases(rule["alert"]) if case.get("exp_alerts")]
    assert fires, f"{rule['alert']} has no alert_rule_test in {RULES_TEST.name} where it fires"


@pytest.mark.parametrize("rule", rule_params(alerts_only=True))
def test_every_alert_has_a_case_where_it_is_quiet(rule: Obj) -> None:
    quiet = [case for case in alert_cases(rule["alert"]) if not case.get("exp_alerts")]
    assert quiet, f"{rule['alert']} has no alert_rule_test in {RULES_TEST.name} where it is quiet"
