"""``fracgpu node-cleanup`` against the fake API server: what the node agents published goes,
nothing else does, and nothing goes while a node agent still runs."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from core.dra import DRIVER
from core.labels import COUNT_LABEL, FREE_ANNOTATION, INVENTORY_ANNOTATION, PRODUCT_LABEL
from fracgpu.cleanup import node_patch
from fracgpu.cli import build_parser
from testkit.apiserver import FakeApiServer

Obj = dict[str, Any]
NAMESPACE = "fracgpu"


def node(name: str, labels: dict[str, str], annotations: dict[str, str]) -> Obj:
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
    }  # fmt: skip


def resource_slice(name: str, driver: str) -> Obj:
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {"driver": driver, "nodeName": "gpu-1",
                 "pool": {"name": "gpu-1", "generation": 1, "resourceSliceCount": 1},
                 "devices": []},
    }  # fmt: skip


def agent_pod(name: str) -> Obj:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE,
                     "labels": {"app.kubernetes.io/name": "fracgpu-device-plugin"}},
        "spec": {"containers": [{"name": "device-plugin", "image": "fracgpu"}]},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("labels", "annotations", "patch"),
    [
        pytest.param(
            {PRODUCT_LABEL: "H100", COUNT_LABEL: "8", "kubernetes.io/os": "linux"},
            {FREE_ANNOTATION: "{}", "other": "x"},
            {
                "metadata": {
                    "labels": {PRODUCT_LABEL: None, COUNT_LABEL: None},
                    "annotations": {FREE_ANNOTATION: None},
                }
            },
            id="fracgpus-keys-only",
        ),
        pytest.param({"kubernetes.io/os": "linux"}, {}, None, id="nothing-of-fracgpus"),
        pytest.param(
            {},
            {INVENTORY_ANNOTATION: "{}"},
            {"metadata": {"annotations": {INVENTORY_ANNOTATION: None}}},
            id="annotations-only",
        ),
    ],
)
def test_the_patch_names_fracgpus_keys_only(
    labels: dict[str, str], annotations: dict[str, str], patch: Obj | None
) -> None:
    assert node_patch(node("n", labels, annotations)) == patch


@pytest.mark.parametrize(
    ("agent_running", "code"),
    [
        pytest.param(False, 0, id="no-node-agent-left"),
        pytest.param(True, 1, id="a-node-agent-still-runs"),
    ],
)
async def test_node_cleanup_removes_what_the_agents_published(
    tmp_path: Path, agent_running: bool, code: int
) -> None:
    async with FakeApiServer(namespaces=("default", NAMESPACE)) as fake:
        fake.put(node("gpu-1", {PRODUCT_LABEL: "H100", "team": "a"}, {FREE_ANNOTATION: "{}"}))
        fake.put(node("cpu-1", {"team": "b"}, {}))
        fake.put(resource_slice("gpu-1-fracgpu", DRIVER))
        fake.put(resource_slice("gpu-1-other", "gpu.example.com"))
        if agent_running:
            fake.put(agent_pod("fracgpu-device-plugin-x"))
        kubeconfig = fake.kubeconfig(tmp_path / "kubeconfig")
        args = build_parser().parse_args(
            ["node-cleanup", "-n", NAMESPACE, "--wait-s", "0.5", "--kubeconfig", str(kubeconfig)]
        )
        assert await asyncio.to_thread(args.run, args) == code
        gpu = fake.get("nodes", "gpu-1")
        assert gpu is not None
        slices = {s["metadata"]["name"] for s in fake.objects("resourceslices")}
        if agent_running:  # nothing removed while an agent could publish again
            assert PRODUCT_LABEL in gpu["metadata"]["labels"]
            assert slices == {"gpu-1-fracgpu", "gpu-1-other"}
            return
        assert gpu["metadata"]["labels"] == {"team": "a"}
        assert FREE_ANNOTATION not in (gpu["metadata"].get("annotations") or {})
        assert slices == {"gpu-1-other"}
        cpu = fake.get("nodes", "cpu-1")
        assert cpu is not None and cpu["metadata"]["labels"] == {"team": "b"}
