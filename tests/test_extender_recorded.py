"""What a real kube-scheduler (v1.37.2) sent the extender parses with ``extender.wire``: the
bodies in ``tests/data/extender`` were recorded on the project's cluster
(``docs/design/extender-observed.md``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from extender.wire import ExtenderArgs, ExtenderBindingArgs

DATA = Path(__file__).parent / "data" / "extender"


@pytest.mark.parametrize("version", ["v1.37.2"])
def test_the_schedulers_filter_body_parses(version: str) -> None:
    args = ExtenderArgs.model_validate(json.loads((DATA / f"filter-{version}.json").read_text()))
    assert args.node_names == ["127.0.0.1"]  # nodeCacheCapable: names, not Node objects
    assert args.nodes is None
    assert args.pod["metadata"]["name"] == "exptest2"


@pytest.mark.parametrize("version", ["v1.37.2"])
def test_the_schedulers_bind_body_parses(version: str) -> None:
    body = json.loads((DATA / f"bind-{version}.json").read_text())
    args = ExtenderBindingArgs.model_validate(body)
    assert (args.pod_name, args.pod_namespace, args.node) == ("exptest2", "default", "127.0.0.1")
    assert args.pod_uid == body["PodUID"]
