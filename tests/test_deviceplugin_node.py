"""Publishing the inventory on the Node, against the strict fake API server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.labels import (
    COUNT_LABEL,
    FREE_ANNOTATION,
    INVENTORY_ANNOTATION,
    MEMORY_LABEL,
    PRODUCT_LABEL,
)
from deviceplugin.classic.allocator import Allocator
from deviceplugin.classic.config import Config
from deviceplugin.classic.ids import Kind
from deviceplugin.classic.node import NodePublisher, label_safe, node_patch, publish
from deviceplugin.shared.apiloop import ApiLoop
from deviceplugin.shared.inventory import Card
from testkit.apiserver import FakeApiServer

CORE = "fracgpu.io/core"
CARDS = [
    Card(0, "GPU-a", "NVIDIA A100-SXM4-80GB", 81920, 0, 0),
    Card(1, "GPU-b", "NVIDIA A100-SXM4-80GB", 81920, 1, 1),
]


def node(name: str = "gpu-1") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"a": "b"}}}


_LOOPS: list[ApiLoop] = []


def api_loop(config: Config) -> ApiLoop:
    """The agent's API thread, as the daemon makes it; stopped after the test."""
    loop = ApiLoop(config.kubeconfig)
    loop.start()
    _LOOPS.append(loop)
    return loop


@pytest.fixture(autouse=True)
def _stop_loops() -> Iterator[None]:
    yield
    while _LOOPS:
        _LOOPS.pop().stop()


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


def _free(fake: FakeApiServer) -> list[tuple[int, int, int]]:
    stored = fake.get("nodes", "gpu-1") or {}
    text = stored.get("metadata", {}).get("annotations", {}).get(FREE_ANNOTATION)
    if not text:
        return []
    document = json.loads(text)
    assert document["version"] == 1
    return [(c["index"], c["cores"], c["memoryMiB"]) for c in document["cards"]]


async def test_publisher_writes_what_each_card_has_free_as_it_changes(tmp_path: Path) -> None:
    """For the webhook's explanation of a pod that waits Pending (device-plugin mode): what each
    card has free, from the ledger, within a second of a change; a failed card has nothing."""
    from tests.test_deviceplugin_allocator import take

    async with FakeApiServer() as fake:
        fake.put(node())
        config = Config(node_name="gpu-1", kubeconfig=fake.kubeconfig(tmp_path / "kubeconfig"))
        allocator = Allocator(CARDS)  # two 80 GiB cards
        publisher = NodePublisher(config, CARDS, allocator, api_loop(config))
        publisher.start()
        try:
            assert await _until(lambda: _free(fake) == [(0, 100, 81920), (1, 100, 81920)])
            take(allocator, 30, 8)  # best fit among free cards: the lower index
            assert await _until(lambda: _free(fake) == [(0, 70, 79872), (1, 100, 81920)], 3.0)
            allocator.set_health(1, False, "XID 79")
            publisher.poke()
            assert await _until(lambda: _free(fake) == [(0, 70, 79872), (1, 0, 0)], 3.0)
        finally:
            await asyncio.to_thread(publisher.stop)


async def test_publisher_republishes_on_health_change_and_survives_outages(tmp_path: Path) -> None:
    async with FakeApiServer() as fake:
        fake.put(node())
        config = Config(node_name="gpu-1", kubeconfig=fake.kubeconfig(tmp_path / "kubeconfig"))
        allocator = Allocator(CARDS)
        publisher = NodePublisher(config, CARDS, allocator, api_loop(config))
        publisher.start()
        try:
            assert await _until(lambda: _healthy_flags(fake) == [True, True])
            fake.down("503", seconds=0.5)
            allocator.set_health(1, False, "XID 79")
            publisher.poke()
            assert await _until(lambda: _healthy_flags(fake) == [True, False], seconds=8.0)
        finally:
            await asyncio.to_thread(publisher.stop)


# --- the Node's allocatable, written at once ------------------------------------------------


def _small_cards() -> Allocator:
    """Two 4 GiB cards (16 blocks each), on the real clock: the mirror waits on it."""
    cards = [Card(i, f"GPU-{i}", "Fake", 4096, i, None) for i in range(2)]
    return Allocator(cards, settle_s=0.0)  # what is offered, at once


def _allocatable(fake: FakeApiServer) -> dict[str, str]:
    stored = fake.get("nodes", "gpu-1") or {}
    allocatable: dict[str, str] = (stored.get("status") or {}).get("allocatable") or {}
    return allocatable


async def test_the_nodes_allocatable_follows_what_the_plugin_advertises(tmp_path: Path) -> None:
    """What kube-scheduler places pods by, written as soon as the plugin's lists change instead
    of at kubelet's next node-status update (10 s): a second partly used card hides its free
    IDs, an unhealthy card lists none; other resources are left alone."""
    from deviceplugin.classic.node import AllocatableMirror
    from tests.test_deviceplugin_allocator import take

    async with FakeApiServer() as fake:
        fake.put({**node(), "status": {"allocatable": {"cpu": "8", "fracgpu.io/core": "0"}}})
        config = Config(node_name="gpu-1", kubeconfig=fake.kubeconfig(tmp_path / "kubeconfig"))
        allocator = _small_cards()  # 2 cards x 16 blocks
        mirror = AllocatableMirror(config, allocator, api_loop(config))
        mirror.start()
        try:
            expected = {"cpu": "8", "fracgpu.io/core": "200", "fracgpu.io/memory": "32"}
            assert await _until(lambda: _allocatable(fake) == expected)
            take(allocator, 60, 8)  # card A: 0.6 card, the open one
            take(allocator, 60, 8)  # card B: the second partly used card, whose free IDs hide
            expected = {"cpu": "8", "fracgpu.io/core": "160", "fracgpu.io/memory": "24"}
            assert await _until(lambda: _allocatable(fake) == expected, seconds=2.0)
            allocator.set_health(0, False, "XID 79")
            assert await _until(
                lambda: _allocatable(fake)["fracgpu.io/core"] == str(mirror.counts()[CORE]),
                seconds=2.0,
            )
            assert mirror.counts()[CORE] < 160
        finally:
            await asyncio.to_thread(mirror.stop)


async def test_a_stale_write_by_kubelet_right_after_a_change_is_corrected(tmp_path: Path) -> None:
    """kubelet may write the count it had before it read the plugin's new lists: the mirror
    writes each change again a second later."""
    from deviceplugin.classic.node import AllocatableMirror

    async with FakeApiServer() as fake:
        fake.put(node())
        config = Config(node_name="gpu-1", kubeconfig=fake.kubeconfig(tmp_path / "kubeconfig"))
        allocator = _small_cards()
        mirror = AllocatableMirror(config, allocator, api_loop(config), confirm_after_s=0.5)
        mirror.start()
        try:
            assert await _until(lambda: _allocatable(fake).get(CORE) == "200")
            allocator.set_health(1, False, "XID 79")
            assert await _until(lambda: _allocatable(fake).get(CORE) == "100", seconds=2.0)
            stale = fake.get("nodes", "gpu-1") or {}
            stale["status"]["allocatable"][CORE] = "200"  # kubelet, from its older lists
            fake.put(stale)
            assert await _until(lambda: _allocatable(fake).get(CORE) == "100", seconds=2.0)
        finally:
            await asyncio.to_thread(mirror.stop)


async def test_the_mirror_survives_an_api_outage(tmp_path: Path) -> None:
    from deviceplugin.classic.node import AllocatableMirror

    async with FakeApiServer() as fake:
        fake.put(node())
        config = Config(node_name="gpu-1", kubeconfig=fake.kubeconfig(tmp_path / "kubeconfig"))
        allocator = _small_cards()
        mirror = AllocatableMirror(config, allocator, api_loop(config), retry_s=0.1)
        fake.down("503", seconds=0.5)
        mirror.start()
        try:
            assert await _until(lambda: _allocatable(fake).get(CORE) == "200", seconds=5.0)
        finally:
            await asyncio.to_thread(mirror.stop)


async def test_nothing_is_written_before_kubelet_has_registered_the_resources(
    tmp_path: Path,
) -> None:
    """A Node offering fracgpu resources kubelet does not know yet would draw pods that
    kubelet cannot admit: the mirror writes only once the plugin is registered."""
    from deviceplugin.classic.node import AllocatableMirror

    async with FakeApiServer() as fake:
        fake.put(node())
        config = Config(node_name="gpu-1", kubeconfig=fake.kubeconfig(tmp_path / "kubeconfig"))
        registered = False
        mirror = AllocatableMirror(
            config, _small_cards(), api_loop(config), registered=lambda: registered
        )
        mirror.start()
        try:
            await asyncio.sleep(0.5)
            assert CORE not in _allocatable(fake)
            registered = True
            assert await _until(lambda: _allocatable(fake).get(CORE) == "200", seconds=2.0)
        finally:
            await asyncio.to_thread(mirror.stop)


async def test_a_stopping_plugin_withdraws_the_nodes_allocatable(tmp_path: Path) -> None:
    """While no plugin serves the resources kubelet refuses every pod asking for them; the
    stopping plugin sets them to 0 first, so the scheduler places none there meanwhile."""
    from deviceplugin.classic.node import AllocatableMirror

    async with FakeApiServer() as fake:
        fake.put({**node(), "status": {"allocatable": {"cpu": "8"}}})
        config = Config(node_name="gpu-1", kubeconfig=fake.kubeconfig(tmp_path / "kubeconfig"))
        mirror = AllocatableMirror(config, _small_cards(), api_loop(config))
        mirror.start()
        try:
            assert await _until(lambda: _allocatable(fake).get(CORE) == "200")
        finally:
            await asyncio.to_thread(mirror.stop)
        assert await asyncio.to_thread(mirror.withdraw)
        assert _allocatable(fake) == {"cpu": "8", CORE: "0", "fracgpu.io/memory": "0"}
        fake.down("503", seconds=5.0)
        assert not await asyncio.to_thread(mirror.withdraw, 0.5)  # logged, never raised


async def test_the_nodes_allocatable_keeps_hidden_capacity_shorter_than_kubelets_lists(
    tmp_path: Path,
) -> None:
    """A 0.5 share that must take the free card hides the open card's 0.4: the Node's
    allocatable keeps it for SETTLE_S, kubelet's lists for twice as long, so a pod the
    scheduler bound at the end of the Node's moment is still in kubelet's count."""
    from deviceplugin.classic.node import AllocatableMirror
    from tests.test_deviceplugin_allocator import healthy, take

    async with FakeApiServer() as fake:
        fake.put(node())
        config = Config(node_name="gpu-1", kubeconfig=fake.kubeconfig(tmp_path / "kubeconfig"))
        cards = [Card(i, f"GPU-{i}", "Fake", 4096, i, None) for i in range(2)]
        allocator = Allocator(cards, settle_s=1.0)
        mirror = AllocatableMirror(config, allocator, api_loop(config))
        mirror.start()
        try:
            take(allocator, 60, 8)
            take(allocator, 50, 4)
            assert await _until(lambda: _allocatable(fake).get(CORE) == "200", seconds=0.5)
            assert await _until(lambda: _allocatable(fake).get(CORE) == "160", seconds=3.0)
            assert len(healthy(allocator, Kind.CORE)) == 200  # the lists keep it longer
            stale = fake.get("nodes", "gpu-1") or {}
            stale["status"]["allocatable"][CORE] = "200"  # kubelet writes its lists' count
            fake.put(stale)
            assert await _until(lambda: _allocatable(fake).get(CORE) == "160", seconds=1.5)
        finally:
            await asyncio.to_thread(mirror.stop)
