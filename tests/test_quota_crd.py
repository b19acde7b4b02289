"""The GPUQuota CRD: structural, with validation that agrees with what fracgpu parses."""

import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from core.units import UnitError, parse_cards, parse_mib
from quota.model import QuotaStatus

CRD = yaml.safe_load((Path(__file__).parents[1] / "deploy/crds/gpuquota.yaml").read_text())
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]
SPEC = SCHEMA["properties"]["spec"]["properties"]


def _nodes(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = [(path, node)]
    for name, child in (node.get("properties") or {}).items():
        found += _nodes(child, f"{path}.{name}")
    if isinstance(node.get("additionalProperties"), dict):
        found += _nodes(node["additionalProperties"], f"{path}.*")
    if isinstance(node.get("items"), dict):
        found += _nodes(node["items"], f"{path}[]")
    return found


def test_structural() -> None:
    assert CRD["spec"]["group"] == "fracgpu.io"
    assert CRD["spec"]["scope"] == "Namespaced"
    assert VERSION["subresources"] == {"status": {}}
    for path, node in _nodes(SCHEMA):
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path


@pytest.mark.parametrize(
    "column", [pytest.param(c, id=c["name"]) for c in VERSION["additionalPrinterColumns"]]
)
def test_printer_columns_read_fields_fracgpu_writes(column: dict[str, Any]) -> None:
    status = QuotaStatus().model_dump(by_alias=True)
    parts = column["jsonPath"].lstrip(".").split(".")
    root = parts[0]
    assert root in ("metadata", "spec", "status"), column
    if root == "spec":
        assert parts[1] in SPEC, column
    if root == "status":
        field = parts[1].split("[")[0]
        assert field in status, column
        if field == "used":
            assert parts[2] in status["used"], column


# --- the API server's cost budget ------------------------------------------------------------
#
# kube-apiserver estimates each x-kubernetes-validations rule's worst-case cost when the CRD is
# written and refuses the CRD when one rule exceeds 10,000,000 or all rules together exceed
# 100,000,000. The estimate is cel-go's: `s.matches(re)` costs ceil((len(s) + 1) * 0.1) *
# ceil(len(re) * 0.25), other string traversals ceil(len(s) * 0.1), a macro over a list or map
# its body times the collection's size, everything else about 1 per operation. Sizes come from
# the schema: a string's maxLength; an x-kubernetes-int-or-string value, a map key or an
# unbounded string is sized at the 3 MiB request limit whatever the schema says. And a rule on
# a node inside maps or arrays runs once per element: its cost is multiplied by every enclosing
# maxProperties / maxItems (unbounded: as many elements as fit in a request).

MAX_REQUEST_BYTES = 3 * 1024 * 1024
RULE_LIMIT = 1_000_000  # stricter than the API server's 10,000,000 per rule, on purpose
SERVER_RULE_LIMIT = 10_000_000
CRD_LIMIT = 100_000_000


def _string_size(node: dict[str, Any]) -> int:
    if node.get("x-kubernetes-int-or-string"):
        return MAX_REQUEST_BYTES
    return int(node.get("maxLength", MAX_REQUEST_BYTES))


def _collection_size(node: dict[str, Any]) -> int:
    if node.get("type") == "array":
        return int(node.get("maxItems", MAX_REQUEST_BYTES // 2))
    return int(node.get("maxProperties", MAX_REQUEST_BYTES // 4))


def rule_cost(node: dict[str, Any], rule: str) -> int:
    """The worst-case cost of one evaluation of ``rule`` on ``node``, as estimated above."""
    macro = re.search(r"self\.(all|exists|exists_one|map|filter)\(", rule)
    # Inside a macro over a map the strings are its keys: unbounded by any schema.
    size = MAX_REQUEST_BYTES if macro else _string_size(node)
    cost = len(re.findall(r"[A-Za-z_]\w*|[<>=!]=|&&|\|\||[-+*/%<>?:]", rule))
    for regex in re.findall(r"matches\('((?:[^'\\]|\\.)*)'\)", rule):
        pattern = regex.replace("\\\\", "\\")
        cost += math.ceil((size + 1) * 0.1) * math.ceil(len(pattern) * 0.25)
    for _ in re.findall(r"\.(replace|contains|startsWith|endsWith|lowerAscii|upperAscii)\(", rule):
        cost += math.ceil(size * 0.1)
    if macro:
        cost *= _collection_size(node)
    return cost


def _rules(
    node: dict[str, Any], path: str = "", repeat: int = 1
) -> list[tuple[str, dict[str, Any], str, int]]:
    """Every rule with its node, its path and how often it runs per object (at most)."""
    found = [(path, node, v["rule"], repeat) for v in node.get("x-kubernetes-validations", [])]
    for name, child in (node.get("properties") or {}).items():
        found += _rules(child, f"{path}.{name}", repeat)
    if isinstance(node.get("additionalProperties"), dict):
        found += _rules(node["additionalProperties"], f"{path}.*", repeat * _collection_size(node))
    if isinstance(node.get("items"), dict):
        found += _rules(node["items"], f"{path}[]", repeat * _collection_size(node))
    return found


# The first GPUQuota CRD's rules, with the factor by which a v1.36 API server found them over
# budget: the estimate must reproduce the refusal (within its precision, about 20 %).
_OLD_GPU_RULE = "type(self) == int ? self >= 0 : self.matches('^[0-9]+(\\\\.[0-9]{1,2})?$')"
_OLD_MEMORY_RULE = (
    "type(self) == int ? self >= 0 : (self.matches('^[0-9]+(Mi|Gi|Ti|Pi)?$') || "
    "(self.matches('^[0-9]+Ki$') && int(self.replace('Ki', '')) % 1024 == 0))"
)


@pytest.mark.parametrize(
    ("rule", "observed_factor"),
    [
        pytest.param(_OLD_GPU_RULE, 14.1, id="old-models-gpu-refused-14.1x"),
        pytest.param(_OLD_MEMORY_RULE, 24.2, id="old-models-gpumem-refused-24.2x"),
    ],
)
def test_cost_estimate_reproduces_the_refusal_of_the_old_crd(
    rule: str, observed_factor: float
) -> None:
    models = {"type": "object", "maxProperties": 64}
    node = {"x-kubernetes-int-or-string": True}
    estimate = rule_cost(node, rule) * _collection_size(models) / SERVER_RULE_LIMIT
    assert estimate > 1  # refused, as it was
    assert 0.8 * observed_factor <= estimate <= 1.2 * observed_factor


RULES = _rules(SCHEMA)


@pytest.mark.parametrize(
    ("path", "node", "rule", "repeat"), [pytest.param(*r, id=f"{r[0]}:{r[2]}") for r in RULES]
)
def test_every_rule_is_within_the_per_rule_budget(
    path: str, node: dict[str, Any], rule: str, repeat: int
) -> None:
    assert rule_cost(node, rule) * repeat <= RULE_LIMIT, path


def test_all_rules_together_are_within_the_crd_budget() -> None:
    total = sum(rule_cost(node, rule) * repeat for _, node, rule, repeat in RULES)
    assert total <= CRD_LIMIT


def _unbounded(node: dict[str, Any], path: str) -> list[str]:
    """Paths of strings, maps and arrays below ``node`` that declare no bound."""
    found = []
    if node.get("type") == "string" and "maxLength" not in node and "enum" not in node:
        found.append(path)
    if node.get("x-kubernetes-int-or-string") and "maxLength" not in node:
        found.append(path)
    if isinstance(node.get("additionalProperties"), dict) and "maxProperties" not in node:
        found.append(path)
    if node.get("type") == "array" and "maxItems" not in node:
        found.append(path)
    for name, child in (node.get("properties") or {}).items():
        if path == "" and name == "metadata":
            continue  # the API server's own ObjectMeta, bounded by it
        found += _unbounded(child, f"{path}.{name}")
    for key in ("additionalProperties", "items"):
        if isinstance(node.get(key), dict):
            found += _unbounded(node[key], f"{path}.*")
    return found


def test_every_string_map_and_array_is_bounded() -> None:
    assert _unbounded(SCHEMA, "") == []


def test_rules_sit_on_bounded_nodes() -> None:
    for path, node, _, _ in RULES:
        assert _unbounded(node, path) == [], path


@pytest.mark.parametrize(
    "column", [pytest.param(c, id=c["name"]) for c in VERSION["additionalPrinterColumns"]]
)
def test_limit_columns_show_before_any_status(column: dict[str, Any]) -> None:
    """A new quota shows its limits at once; usage columns wait for the controller's count."""
    if "Limit" in column["name"]:
        assert column["jsonPath"].startswith(".spec."), column


def _pattern(field: str) -> str:
    return str(SPEC[field]["pattern"])


@pytest.mark.parametrize("text", ["4", "4.5", "0.25", "12.00", "4.555", "1e3", "-1", "4.", "300m"])
def test_cards_pattern_agrees_with_the_parser(text: str) -> None:
    try:
        parse_cards(text, source="quota")
        parsed = True
    except UnitError:
        parsed = False
    # The API server is stricter (no SI suffixes); it never accepts what fracgpu rejects.
    accepted = re.match(_pattern("gpu"), text) is not None
    assert not accepted or parsed
    if text in ("4", "4.5", "0.25", "12.00"):
        assert accepted


@pytest.mark.parametrize("text", ["65536", "64Gi", "512Mi", "2048Ki", "1Ki", "64G", "1.5Gi", "x"])
def test_memory_pattern_agrees_with_the_parser(text: str) -> None:
    accepted = re.match(_pattern("gpumem"), text) is not None
    try:
        parse_mib(text, source="quota")
        parsed = True
    except UnitError:
        parsed = False
    assert not accepted or parsed, text  # the API server never accepts what fracgpu rejects
    if text in ("65536", "64Gi", "512Mi"):
        assert accepted
