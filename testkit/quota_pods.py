"""Canonical pods and GPUQuota objects for the quota tests (builders, not fakes)."""

from __future__ import annotations

import uuid
from typing import Any

from core.units import CORE, MEMORY


def container(name: str, core: int = 0, blocks: int = 0, **extra: Any) -> dict[str, Any]:
    # A whole card carries fracgpu.io/core alone (it gets all of its card's memory).
    limits = {CORE: str(core)} if core else {}
    if blocks:
        limits[MEMORY] = str(blocks)
    return {"name": name, "image": "x", "resources": {"limits": limits}, **extra}


def gpu_pod(
    name: str,
    core: int = 50,
    blocks: int = 32,
    namespace: str = "team-a",
    *,
    uid: str | None = None,
    init: list[dict[str, Any]] | None = None,
    node_selector: dict[str, str] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [container("main", core, blocks)]}
    if init:
        spec["initContainers"] = init
    if node_selector:
        spec["nodeSelector"] = node_selector
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": uid or str(uuid.uuid4())},
        "spec": spec,
    }


def plain_pod(name: str, namespace: str = "team-a") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4())},
        "spec": {"containers": [{"name": "main", "image": "x"}]},
    }


def gpu_quota(name: str = "team-a", namespace: str = "team-a", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "fracgpu.io/v1",
        "kind": "GPUQuota",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def review(
    pod: dict[str, Any], *, dry_run: bool = False, operation: str = "CREATE"
) -> dict[str, Any]:
    return {
        "uid": str(uuid.uuid4()),
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "name": pod["metadata"]["name"],
        "namespace": pod["metadata"]["namespace"],
        "operation": operation,
        "object": pod,
        "dryRun": dry_run,
    }


def counted_quota(name: str = "team-a", namespace: str = "team-a", **spec: Any) -> dict[str, Any]:
    """A GPUQuota as the controller leaves it once it has counted an empty namespace."""
    quota = gpu_quota(name, namespace, **spec)
    quota["metadata"]["generation"] = 1
    quota["status"] = {
        "observedGeneration": 1,
        "conditions": [{"type": "Counted", "status": "True", "reason": "Counted"}],
    }
    return quota
