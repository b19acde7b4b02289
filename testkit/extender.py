"""Objects for extender tests: Nodes carrying a card inventory, and canonical GPU pods.

The shapes are what the device plugin publishes (``fracgpu.io/gpu.inventory``) and what
admission leaves on a pod (canonical ``fracgpu.io/core``/``memory`` limits), written by hand so
that the tests read as the API server would show the objects.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from core.labels import INVENTORY_ANNOTATION, INVENTORY_VERSION, MODEL_ANNOTATION
from core.units import CORE, MEMORY

A100 = "NVIDIA A100-SXM4-40GB"
L4 = "NVIDIA L4"


@dataclass(frozen=True)
class Gpu:
    """One card of a test node."""

    uuid: str
    product: str = L4
    memory_mib: int = 24 * 1024
    healthy: bool = True
    numa_node: int | None = 0


def node(name: str, *gpus: Gpu, inventory: bool = True) -> dict[str, Any]:
    """A Node whose device plugin published ``gpus``."""
    annotations: dict[str, str] = {}
    if inventory:
        document = {
            "version": INVENTORY_VERSION,
            "cards": [
                {
                    "index": i,
                    "uuid": g.uuid,
                    "product": g.product,
                    "memoryMiB": g.memory_mib,
                    "minor": i,
                    "numaNode": g.numa_node,
                    "healthy": g.healthy,
                }
                for i, g in enumerate(gpus)
            ],
        }
        annotations[INVENTORY_ANNOTATION] = json.dumps(document)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "annotations": annotations},
    }


def pod(
    name: str = "p",
    *shares: tuple[int, int],
    uid: str | None = None,
    namespace: str = "team",
    models: str | None = None,
    node_name: str | None = None,
) -> dict[str, Any]:
    """A canonical GPU pod: one container per (core, memory blocks) share, ``c0``, ``c1``…"""
    containers = []
    for i, (core, memory) in enumerate(shares):
        limits = {CORE: str(core)}
        if memory:
            limits[MEMORY] = str(memory)
        containers.append({"name": f"c{i}", "image": "x", "resources": {"limits": limits}})
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "uid": uid or f"uid-{name}"}
    if models is not None:
        meta["annotations"] = {MODEL_ANNOTATION: models}
    spec: dict[str, Any] = {"containers": containers, "schedulerName": "fracgpu-scheduler"}
    if node_name:
        spec["nodeName"] = node_name
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}
