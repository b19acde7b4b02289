"""Objects the e2e scenarios create, and what the project's own code says must become of them."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
import yaml

from core.labels import MODEL_ANNOTATION, MODEL_EXCLUDE_ANNOTATION
from quota.offline import QuotaDecision, review_pods_async
from tests.e2e.harness import (
    ADMISSION,
    CARD_PRODUCT,
    DEFAULT_IMAGE,
    DEFAULT_SHELL_IMAGE,
    ENV_IMAGE,
    ENV_SHELL_IMAGE,
)
from webhook.config import AdmissionConfig
from webhook.inventory import Inventory
from webhook.mutation import MutationOutcome, Mutator

Obj = dict[str, Any]
IMAGE = os.environ.get(ENV_IMAGE) or DEFAULT_IMAGE
SHELL_IMAGE = os.environ.get(ENV_SHELL_IMAGE) or DEFAULT_SHELL_IMAGE
# Pods of the admission and quota scenarios are never scheduled: nothing has this label.
NOWHERE = {"fracgpu.io/e2e-never": "true"}


def container(name: str, limits: Obj | None = None) -> Obj:
    c: Obj = {"name": name, "image": IMAGE}
    if limits:
        c["resources"] = {"limits": limits}
    return c


def pod(name: str, limits: Obj, *, node_selector: Obj | None = None) -> Obj:
    spec: Obj = {"containers": [container("main", limits)], "nodeSelector": NOWHERE}
    if node_selector is not None:
        spec["nodeSelector"] = node_selector
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def gpu_pod(name: str, gpu: str, gpumem: str | None = None) -> Obj:
    limits = {"fracgpu.io/gpu": gpu}
    if gpumem is not None:
        limits["fracgpu.io/gpumem"] = gpumem
    return pod(name, limits)


def plain_pod(name: str) -> Obj:
    return pod(name, {"cpu": "100m", "memory": "64Mi"})


def deployment(name: str, limits: Obj) -> Obj:
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
                "spec": {"containers": [container("main", limits)], "nodeSelector": NOWHERE},
            },
        },
    }


def gpu_quota(name: str, **spec: Any) -> Obj:
    return {"apiVersion": "fracgpu.io/v1", "kind": "GPUQuota", "metadata": {"name": name},
            "spec": spec}  # fmt: skip


def manifest(obj: Obj) -> str:
    return yaml.safe_dump(obj)


def local_mutator() -> Mutator:
    """The mutation the local webhook runs: built from the configuration it is given."""
    config = AdmissionConfig.model_validate(ADMISSION)
    return Mutator(config, Inventory(config.inventory.models))


def expected(obj: Obj) -> tuple[MutationOutcome, Obj]:
    """What the webhook decides for an object, and the object after its patch.

    The API server hands the webhook quantities in its canonical form (``300m`` for ``0.3``);
    the webhook reads and reports both forms alike, so the manifest as written is used here."""
    group = obj["apiVersion"].rpartition("/")[0] if "/" in obj["apiVersion"] else ""
    outcome = local_mutator().mutate(obj, group, obj["kind"])
    patched: Obj = jsonpatch.apply_patch(copy.deepcopy(obj), outcome.patch)
    return outcome, patched


async def expected_quota(
    workdir: Path, namespace: str, quota: Obj, pods: list[Obj]
) -> list[QuotaDecision]:
    """The quota decisions for ``pods`` created one after another in ``namespace`` under
    ``quota``, by the same engine as the webhook (``fracgpu review --quota``)."""
    path = workdir / f"quota-{namespace}.yaml"
    path.write_text(yaml.safe_dump({**quota, "metadata": {**quota["metadata"],
                                                          "namespace": namespace}}))  # fmt: skip
    mutated = []
    for obj in pods:
        _, patched = expected(obj)
        patched["metadata"] = {**patched["metadata"], "namespace": namespace}
        mutated.append(patched)
    return await review_pods_async(path, mutated)


# Model choices admission cannot honour on the suite's cluster (one model, CARD_PRODUCT), and what
# its denial says: both modes refuse them at create.
UNHONOURABLE_MODEL_CHOICES = [
    pytest.param(
        {MODEL_ANNOTATION: "NVIDIA H1000"},
        f"{MODEL_ANNOTATION} 'NVIDIA H1000' matches no GPU model in this cluster",
        id="a-model-the-cluster-has-not",
    ),
    pytest.param(
        {MODEL_EXCLUDE_ANNOTATION: CARD_PRODUCT},
        "no GPU model of this cluster is left",
        id="the-only-model-excluded",
    ),
]


# (name, limits): the suite's churn mix, drawn at random; memory-heavy shares and whole cards beside
# proportional shares, so that the two resources run out on different cards
CHURN_SHAPES = [
    ("small", {"fracgpu.io/gpu": "0.1"}),
    ("third", {"fracgpu.io/gpu": "0.3"}),
    ("half-little-memory", {"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "1024"}),
    ("memory-heavy", {"fracgpu.io/gpu": "0.1", "fracgpu.io/gpumem": "16Gi"}),
    ("most", {"fracgpu.io/gpu": "0.7"}),
    ("whole", {"fracgpu.io/gpu": "1"}),
    ("two-whole", {"fracgpu.io/gpu": "2"}),
]
