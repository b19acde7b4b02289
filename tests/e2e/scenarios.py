"""Objects the e2e scenarios create, and what the webhook's own code says must become of them."""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import yaml

from tests.e2e.harness import MODELS
from webhook.config import AdmissionConfig, InventoryConfig
from webhook.inventory import Inventory
from webhook.mutation import Mutator, Outcome

Obj = dict[str, Any]
IMAGE = "registry.k8s.io/pause:3.10"


def container(name: str, limits: Obj | None = None) -> Obj:
    c: Obj = {"name": name, "image": IMAGE}
    if limits:
        c["resources"] = {"limits": limits}
    return c


def gpu_pod(name: str, gpu: str, gpumem: str | None = None) -> Obj:
    limits = {"fracgpu.io/gpu": gpu}
    if gpumem is not None:
        limits["fracgpu.io/gpumem"] = gpumem
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [container("main", limits)]},
    }


def plain_pod(name: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [container("main", {"cpu": "100m", "memory": "64Mi"})]},
    }


def deployment(name: str, gpu: str) -> Obj:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [container("main", {"fracgpu.io/gpu": gpu})]},
            },
        },
    }


def manifest(obj: Obj) -> str:
    return yaml.safe_dump(obj)


def local_mutator() -> Mutator:
    """The mutation the local webhook runs (same defaults, same GPU models)."""
    config = AdmissionConfig(inventory=InventoryConfig(models=MODELS, watch_nodes=False))
    return Mutator(config, Inventory(MODELS))


def expected(obj: Obj) -> tuple[Outcome, Obj]:
    """What the webhook decides for an object, and the object after its patch."""
    group = obj["apiVersion"].rpartition("/")[0] if "/" in obj["apiVersion"] else ""
    outcome = local_mutator().mutate(obj, group, obj["kind"])
    patched: Obj = jsonpatch.apply_patch(copy.deepcopy(obj), outcome.patch)
    return outcome, patched
