"""The GPUQuota CRD: structural, with validation that agrees with what fracgpu parses."""

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


def test_printer_columns_read_status_fields() -> None:
    status = QuotaStatus.model_validate({}).model_dump(by_alias=True)
    status["hard"] = {"cards": "4.00", "memoryMiB": 1}
    for column in VERSION["additionalPrinterColumns"]:
        parts = column["jsonPath"].lstrip(".").split(".")
        if parts[0] == "metadata":
            continue
        assert parts[0] == "status", column
        value: Any = status
        for part in parts[1:]:
            value = value[part]
        assert value is not None, column


def _cel_regexes(rule: str) -> list[str]:
    return [r.replace("\\\\", "\\") for r in re.findall(r"matches\('([^']*)'\)", rule)]


@pytest.mark.parametrize("text", ["4", "4.5", "0.25", "12.00", "4.555", "1e3", "-1", "4.", "300m"])
def test_cards_rule_agrees_with_the_parser(text: str) -> None:
    rule = SPEC["gpu"]["x-kubernetes-validations"][0]["rule"]
    (pattern,) = _cel_regexes(rule)
    try:
        parse_cards(text, source="quota")
        parsed = True
    except UnitError:
        parsed = False
    # The API server is stricter (no SI suffixes); it never accepts what fracgpu rejects.
    accepted = re.match(pattern, text) is not None
    assert not accepted or parsed
    if text in ("4", "4.5", "0.25", "12.00"):
        assert accepted


@pytest.mark.parametrize("text", ["65536", "64Gi", "512Mi", "2048Ki", "1Ki", "64G", "1.5Gi", "x"])
def test_memory_rule_agrees_with_the_parser(text: str) -> None:
    rule = SPEC["gpumem"]["x-kubernetes-validations"][0]["rule"]
    plain, kib = _cel_regexes(rule)
    accepted = re.match(plain, text) is not None or (
        re.match(kib, text) is not None and int(text[:-2]) % 1024 == 0
    )
    try:
        parse_mib(text, source="quota")
        parsed = True
    except UnitError:
        parsed = False
    assert not accepted or parsed, text  # the API server never accepts what fracgpu rejects
    if text in ("65536", "64Gi", "512Mi", "2048Ki"):
        assert accepted
