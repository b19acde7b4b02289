"""Publishing the inventory on the Node, against the strict fake API server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from core.labels import COUNT_LABEL, INVENTORY_ANNOTATION, MEMORY_LABEL, PRODUCT_LABEL
from deviceplugin.allocator import Allocator
from deviceplugin.config import Config
from deviceplugin.inventory import Card
from deviceplugin.node import NodePublisher, label_safe, node_patch, publish
from tests.fakes.apiserver import FakeApiServer

CARDS = [
    Card(0, "GPU-a", "NVIDIA A100-SXM4-80GB", 81920, 0, 0),
    Card(1, "GPU-b", "NVIDIA A100-SXM4-80GB", 81920, 1, 1),
]


def node(name: str = "gpu-1") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"a": "b"}}}


def test_label_safe_product_names() -> None:
    assert label_safe("NVIDIA A100-SXM4-80GB") == "NVIDIA-A100-SXM4-80GB"
    assert label_safe("  (Tesla) T4 ") == "Tesla-T4"
    assert label_safe("x" * 80) == "x" * 63
    assert label_safe("()") == "unknown"


def test_patch_describes_cards_and_mixed_nodes() -> None:
    patch = node_patch(CARDS, {0: True, 1: False})
    labels = patch["metadata"]["labels"]
    assert labels == {
        COUNT_LABEL: "2",
        PRODUCT_LABEL: "NVIDIA-A100-SXM4-80GB",
        MEMORY_LABEL: "81920",
    }
    inventory = json.loads(patch["metadata"]["annotations"][INVENTORY_ANNOTATION])
    assert inventory["version"] == 1
    assert inventory["cards"][1] == {
        "index": 1,
        "uuid": "GPU-b",
        "product": "NVIDIA A100-SXM4-80GB",
        "memoryMiB": 81920,
        "minor": 1,
        "numaNode": 1,
        "healthy": False,
    }
    mixed = node_patch([*CARDS, Card(2, "GPU-c", "Tesla T4", 15360, 2, None)], {})
    assert mixed["metadata"]["labels"][PRODUCT_LABEL] == "mixed"
    assert mixed["metadata"]["labels"][MEMORY_LABEL] == "15360"


async def test_publish_merges_into_the_node() -> None:
    async with FakeApiServer() as fake:
        fake.put(node())
        async with fake.api_client() as api_client:
            await publish(api_client, "gpu-1", node_patch(CARDS, {0: True}))
        stored = fake.get("nodes", "gpu-1")
        assert stored is not None
        assert stored["metadata"]["labels"]["a"] == "b"  # other labels untouched
        assert stored["metadata"]["labels"][COUNT_LABEL] == "2"
        assert INVENTORY_ANNOTATION in stored["metadata"]["annotations"]


async def _until(predicate: Any, seconds: float = 5.0) -> bool:
    """Poll the fake's store (the publisher runs in its own thread and event loop)."""
    for _ in range(int(seconds / 0.02)):
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return bool(predicate())


def _healthy_flags(fake: FakeApiServer) -> list[bool]:
    stored = fake.get("nodes", "gpu-1") or {}
    text = stored.get("metadata", {}).get("annotations", {}).get(INVENTORY_ANNOTATION)
    return [c["healthy"] for c in json.loads(text)["cards"]] if text else []


async def test_publisher_republishes_on_health_change_and_survives_outages(tmp_path: Path) -> None:
    async with FakeApiServer() as fake:
        fake.put(node())
        config = Config(node_name="gpu-1", kubeconfig=fake.kubeconfig(tmp_path / "kubeconfig"))
        allocator = Allocator(CARDS)
        publisher = NodePublisher(config, CARDS, allocator)
        publisher.start()
        try:
            assert await _until(lambda: _healthy_flags(fake) == [True, True])
            fake.down("503", seconds=0.5)
            allocator.set_health(1, False, "XID 79")
            publisher.poke()
            assert await _until(lambda: _healthy_flags(fake) == [True, False], seconds=8.0)
        finally:
            await asyncio.to_thread(publisher.stop)
