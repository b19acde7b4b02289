"""kube-scheduler's extender wire types: Go field names, lists never null, score range."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from extender.wire import (
    ExtenderArgs,
    ExtenderBindingArgs,
    ExtenderBindingResult,
    ExtenderFilterResult,
    HostPriority,
    NodeList,
    priorities_wire,
)

POD = {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}}

ARGS = [
    pytest.param({"Pod": POD, "Nodes": None, "NodeNames": ["a", "b"]}, ["a", "b"], id="names"),
    pytest.param(
        {"Pod": POD, "Nodes": {"items": [{"metadata": {"name": "a"}}]}, "NodeNames": None},
        ["a"],
        id="node list",
    ),
    pytest.param({"Pod": POD, "Nodes": {"items": None}}, [], id="node list of null items"),
    pytest.param({"Pod": POD}, [], id="neither"),
    pytest.param({"Pod": POD, "NodeNames": [], "Extra": 1}, [], id="unknown keys ignored"),
]


@pytest.mark.parametrize(("body", "names"), ARGS)
def test_extender_args(body: dict[str, Any], names: list[str]) -> None:
    args = ExtenderArgs.model_validate(body)
    assert args.names() == names
    assert args.pod == POD


def test_args_without_a_pod_are_refused() -> None:
    with pytest.raises(ValidationError):
        ExtenderArgs.model_validate({"NodeNames": ["a"]})


FILTER = [
    pytest.param(
        ExtenderFilterResult(),
        {
            "Nodes": None,
            "NodeNames": [],
            "FailedNodes": {},
            "FailedAndUnresolvableNodes": {},
            "Error": "",
        },
        id="nothing passes: an empty list, never null",
    ),
    pytest.param(
        ExtenderFilterResult(
            node_names=["a"], failed_nodes={"b": "full"}, failed_and_unresolvable={"c": "no"}
        ),
        {
            "Nodes": None,
            "NodeNames": ["a"],
            "FailedNodes": {"b": "full"},
            "FailedAndUnresolvableNodes": {"c": "no"},
            "Error": "",
        },
        id="each kind of node",
    ),
    pytest.param(
        ExtenderFilterResult(nodes=NodeList(items=[{"metadata": {"name": "a"}}])),
        {
            "Nodes": {"items": [{"metadata": {"name": "a"}}]},
            "NodeNames": [],
            "FailedNodes": {},
            "FailedAndUnresolvableNodes": {},
            "Error": "",
        },
        id="node objects back when they came",
    ),
]


@pytest.mark.parametrize(("result", "wire"), FILTER)
def test_filter_result_wire(result: ExtenderFilterResult, wire: dict[str, Any]) -> None:
    assert result.wire() == wire
    assert json.loads(json.dumps(result.wire())) == wire


def test_priorities_are_a_bare_array_with_go_names() -> None:
    scores = [HostPriority(host="a", score=0), HostPriority(host="b", score=10)]
    assert priorities_wire(scores) == [{"Host": "a", "Score": 0}, {"Host": "b", "Score": 10}]


@pytest.mark.parametrize("score", [-1, 11], ids=["below 0", "above 10"])
def test_score_range(score: int) -> None:
    with pytest.raises(ValidationError):
        HostPriority(host="a", score=score)


def test_binding_args_and_result() -> None:
    body = {"PodName": "p", "PodNamespace": "ns", "PodUID": "u", "Node": "n"}
    args = ExtenderBindingArgs.model_validate(body)
    assert (args.pod_name, args.pod_namespace, args.pod_uid, args.node) == ("p", "ns", "u", "n")
    assert args.wire() == body
    assert ExtenderBindingResult().wire() == {"Error": ""}
    assert ExtenderBindingResult(error="x").wire() == {"Error": "x"}


@pytest.mark.parametrize("missing", ["PodName", "PodNamespace", "PodUID", "Node"])
def test_binding_args_need_every_field(missing: str) -> None:
    body = {"PodName": "p", "PodNamespace": "ns", "PodUID": "u", "Node": "n"}
    body[missing] = ""
    with pytest.raises(ValidationError):
        ExtenderBindingArgs.model_validate(body)
