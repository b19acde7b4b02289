"""The cluster the e2e suite runs against is reachable and usable (the scenarios build on this)."""

from __future__ import annotations

from typing import Any

from core.kube import NAMESPACES, SECRETS, call_json


async def test_cluster_answers_and_a_namespace_is_usable(kube_api: Any, e2e_namespace: str) -> None:
    version = await call_json(kube_api, "GET", "/version")
    assert version.get("gitVersion")
    made = await call_json(
        kube_api,
        "POST",
        SECRETS.path(e2e_namespace),
        body={"metadata": {"name": "probe"}, "stringData": {"k": "v"}},
    )
    assert made["data"] == {"k": "dg=="}
    namespace = await call_json(kube_api, "GET", NAMESPACES.path(name=e2e_namespace))
    assert namespace["status"]["phase"] == "Active"
