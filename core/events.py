"""Kubernetes Events on pods: where a pod's owner looks first (``kubectl describe pod``).

fracgpu's components tell users about their pods through Events (the node guard when a container
holds more GPU memory than its grant, admission's waiting-pod explainer in DRA mode). One shape
for all of them, as kubelet writes its own: core/v1 Events named ``<pod>.<hex nanoseconds>``.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from core.kube import EVENTS, Api, call_json


def pod_event(
    *,
    namespace: str,
    pod: str,
    uid: str,
    reason: str,
    message: str,
    component: str,
    host: str = "",
    field_path: str | None = None,
    warning: bool = True,
    now: datetime | None = None,
) -> dict[str, Any]:
    """A core/v1 Event about a pod (``field_path`` points at one of its containers)."""
    stamp = (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
    involved: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": pod,
        "namespace": namespace,
        "uid": uid,
    }
    if field_path:
        involved["fieldPath"] = field_path
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{pod}.{time.time_ns():x}", "namespace": namespace},
        "involvedObject": involved,
        "reason": reason,
        "message": message,
        "type": "Warning" if warning else "Normal",
        "source": {"component": component, **({"host": host} if host else {})},
        "reportingComponent": f"fracgpu.io/{component.removeprefix('fracgpu-')}",
        "reportingInstance": host or component,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


async def post(api: Api, event: dict[str, Any]) -> None:
    await call_json(api, "POST", EVENTS.path(event["metadata"]["namespace"]), body=event)
