"""The device plugin in the extender placement mode (``--placement extender``), against the
strict FakeKubelet, the fake NVML and the fake API server, over real gRPC and HTTP.

Each pod carries the placement record the scheduler extender would have written with its
binding. kubelet must never refuse a pod (no Allocate error, its count check always passes), the
lists must never hide capacity, and every container must land on the card(s) its record names,
or wait for them, never elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from core import contract
from core.placement import (
    PLACEMENT_ANNOTATION,
    CardRoom,
    ContainerPlacement,
    PlacementRecord,
    booked,
    fit,
    render,
)
from deviceplugin.classic.allocation import container_dir_name
from deviceplugin.classic.ids import Kind
from deviceplugin.classic.records import RecordError, RecordUnavailable, target_cards
from deviceplugin.shared.inventory import Card
from deviceplugin.shared.podresources import ContainerDevices
from testkit.apiserver import FakeApiServer
from testkit.gpunode import GIB, GpuNode, cards, gpu_node
from testkit.kubelet import Container, Pod, PreStartFailed

CORE = "fracgpu.io/core"
MEMORY = "fracgpu.io/memory"
NODE = "gpu-1"
BLOCKS = 96  # 24 GiB cards


def uuid(index: int) -> str:
    """The fake NVML's UUID of card ``index`` (testkit.gpunode.cards)."""
    return f"GPU-{index:08x}-fake-4000-8000-{index:012x}"


Shape = tuple[int, int, tuple[int, ...]]  # core, memory blocks, the recorded cards


def share_pod(name: str, *shapes: Shape, node: str | None = NODE, record: bool = True) -> Pod:
    pod = Pod(
        "default",
        name,
        [
            Container(f"c{i}", {CORE: core, MEMORY: memory} if memory else {CORE: core})
            for i, (core, memory, _) in enumerate(shapes)
        ],
    )
    placed = {
        f"c{i}": ContainerPlacement(tuple(uuid(c) for c in on), core, memory)
        for i, (core, memory, on) in enumerate(shapes)
    }
    annotations = {PLACEMENT_ANNOTATION: render(PlacementRecord(node or NODE, placed))}
    _API_PODS[pod.key] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "default",
            **({"annotations": annotations} if record else {}),
        },
        "spec": {
            "nodeName": NODE,
            "containers": [{"name": c.name, "image": "x"} for c in pod.containers],
        },
    }
    return pod


_API_PODS: dict[str, dict[str, Any]] = {}  # pod key -> the pod as the API server holds it


@pytest.fixture(autouse=True)
def _forget_pods() -> Iterator[None]:
    yield
    _API_PODS.clear()


@dataclass(frozen=True)
class Cluster:
    """What a scenario drives: the node, the API server, and the binding of a pod made since
    (the pod with its record, as the extender's Binding leaves it)."""

    node: GpuNode
    fake: FakeApiServer
    bind: Callable[[Pod], None]


async def on_node(tmp_path: Path, count: int, scenario: Callable[[Cluster], None]) -> None:
    """Run ``scenario`` (blocking: kubelet's calls) on a node of ``count`` 24 GiB cards in the
    extender placement mode, with every pod made so far in the fake API server."""
    async with FakeApiServer() as fake:
        fake.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        for pod in _API_PODS.values():
            fake.put(pod)
        kubeconfig = fake.kubeconfig(tmp_path / "kubeconfig")
        loop = asyncio.get_running_loop()

        def bind(pod: Pod) -> None:
            asyncio.run_coroutine_threadsafe(_put(fake, _API_PODS[pod.key]), loop).result(5)

        def run() -> None:
            with extender_node(count, kubeconfig) as node:
                scenario(Cluster(node, fake, bind))

        await asyncio.to_thread(run)


async def _put(fake: FakeApiServer, pod: dict[str, Any]) -> None:
    fake.put(pod)  # on the fake's own loop: its store is not shared across threads


@contextmanager
def extender_node(count: int, kubeconfig: Path) -> Iterator[GpuNode]:
    with gpu_node(
        cards(count, 24 * GIB),
        placement="extender",
        node_name=NODE,
        kubeconfig=kubeconfig,
        stop_drain_s=0.0,
    ) as node:
        yield node


def placed_on(node: GpuNode, core_ids: list[str]) -> tuple[int, ...]:
    allocation = node.plugin.allocator.find(Kind.CORE, core_ids)
    assert allocation is not None
    return tuple(allocation.cards)


def limits_of(node: GpuNode, core_ids: list[str]) -> contract.Limits:
    path = node.config.containers_dir / container_dir_name(core_ids) / "limits" / "limits"
    return contract.Limits.parse(path.read_text())


def cdi_device_nodes(node: GpuNode, core_ids: list[str]) -> list[str]:
    name = container_dir_name(core_ids)
    assert node.config.cdi_root is not None
    spec = json.loads((node.config.cdi_root / f"fracgpu.io-container_{name}.json").read_text())
    return [d["path"] for d in spec["devices"][0]["containerEdits"]["deviceNodes"]]


def assert_nothing_hidden(node: GpuNode, count: int) -> None:
    """Every ID of every card is Healthy in every list kubelet got, allocated or not."""
    kubelet = node.kubelet
    full = {CORE: 100 * count, MEMORY: BLOCKS * count}
    assert {r: kubelet.allocatable(r) for r in full} == full
    assert all(healthy == full[r] for _, r, healthy in kubelet.history), "a list hid capacity"


def burst(count: int) -> list[tuple[Pod, list[Shape]]]:
    """Shares and whole cards on ``count`` cards, recorded on cards the node's own best fit
    would not choose (the last cards first), filling the recorded cards exactly."""
    pods: list[tuple[Pod, list[Shape]]] = []
    whole = (count - 2, count - 1) if count >= 8 else (count - 1,)
    for card in reversed(range(count)):
        if card in whole:
            continue
        for n, (core, memory) in enumerate([(50, 32), (30, 48), (20, 16)]):
            shapes: list[Shape] = [(core, memory, (card,))]
            pods.append((share_pod(f"s{card}-{n}", *shapes), shapes))
    shapes = [(100 * len(whole), 0, whole)]
    pods.append((share_pod("whole", *shapes), shapes))
    return pods


@pytest.mark.parametrize("count", [4, 8], ids=["4-cards", "8-cards"])
async def test_a_burst_lands_every_container_on_its_recorded_card(
    tmp_path: Path, count: int
) -> None:
    pods = burst(count)

    def scenario(cluster: Cluster) -> None:
        node = cluster.node
        kubelet = node.kubelet
        held = {}
        for pod, _ in pods:  # admitted back to back: no Allocate refused, no count short
            assert kubelet.schedulable(pod)
            held[pod.key] = kubelet.admit(pod)
            assert_nothing_hidden(node, count)
        order = list(pods)
        random.Random(count).shuffle(order)
        for pod, _ in order:
            for container in pod.containers:
                kubelet.start_container(pod, container.name)
        for pod, shapes in pods:
            for i, (_, _, on) in enumerate(shapes):
                core = held[pod.key][f"c{i}"][CORE]
                assert placed_on(node, core) == tuple(sorted(on)), pod.key
                assert limits_of(node, core).devices == tuple(uuid(c) for c in sorted(on))
                assert cdi_device_nodes(node, core) == [f"/dev/nvidia{c}" for c in sorted(on)]
        usage = node.plugin.allocator.usage()
        assert all((u.core_used, u.memory_used) == (100, BLOCKS) for u in usage)
        assert_nothing_hidden(node, count)
        assert not kubelet.violations
        assert kubelet.wait_for(lambda: _node_allocatable(cluster.fake) == _full(count))

    await on_node(tmp_path, count, scenario)


def _full(count: int) -> dict[str, str]:
    return {CORE: str(100 * count), MEMORY: str(BLOCKS * count)}


def _node_allocatable(fake: FakeApiServer) -> dict[str, str]:
    stored = fake.get("nodes", NODE) or {}
    allocatable: dict[str, str] = (stored.get("status") or {}).get("allocatable") or {}
    return {k: v for k, v in allocatable.items() if k in (CORE, MEMORY)}


async def test_churn_as_the_extender_books_never_fails_a_pod(tmp_path: Path) -> None:
    """I4 of the design memo: the extender books each pod on a card from the pods it has bound
    (a pod's booking goes the moment it ends, before this plugin has seen it end); kubelet
    admits every pod it binds, and every container lands on its recorded card."""
    count, rng = 4, random.Random(38)
    rooms = [CardRoom(i, uuid(i), BLOCKS) for i in range(count)]
    shapes = [(10, 4), (30, 8), (50, 32), (70, 16), (100, 0), (200, 0)]
    bound: dict[str, tuple[Pod, ContainerPlacement]] = {}
    made: list[tuple[Pod, tuple[int, ...]]] = []
    for n in range(60):  # what the extender decides, step by step
        if bound and rng.random() < 0.4:
            key = rng.choice(sorted(bound))
            made.append((bound.pop(key)[0], ()))  # it ends: its booking is gone at once
            continue
        core, memory = rng.choice(shapes)
        on = fit(booked(rooms, [p for _, p in bound.values()]), core, memory)
        if not on:
            continue  # the extender's filter: not bound here
        cards_ = tuple(c.index for c in on)
        pod = share_pod(f"p{n}", (core, memory, cards_))
        bound[pod.key] = (pod, ContainerPlacement(tuple(c.uuid for c in on), core, memory))
        made.append((pod, cards_))

    def scenario(cluster: Cluster) -> None:
        node = cluster.node
        kubelet = node.kubelet
        for pod, cards_ in made:
            if not cards_:
                kubelet.remove(pod)  # kubelet frees its IDs; the plugin is not told
                continue
            cluster.bind(pod)
            core = kubelet.admit(pod)["c0"][CORE]  # never refused: no AdmissionError
            kubelet.start_container(pod, "c0")  # never waits long: PreStart reads List
            assert placed_on(node, core) == cards_, pod.key
            assert_nothing_hidden(node, count)
        assert not kubelet.violations

    assert sum(1 for _, c in made if c) >= 25 and sum(1 for _, c in made if not c) >= 10
    await on_node(tmp_path, count, scenario)


async def test_a_record_for_another_node_is_refused_saying_so(tmp_path: Path) -> None:
    pod = share_pod("elsewhere", (30, 8, (0,)), node="gpu-2")

    def scenario(cluster: Cluster) -> None:
        node = cluster.node
        node.kubelet.admit(pod)  # Allocate never depends on the card: admitted
        with pytest.raises(PreStartFailed) as failed:
            node.kubelet.start_container(pod, "c0")
        assert failed.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert "is for node 'gpu-2', not this node 'gpu-1'" in failed.value.details
        assert not any(a.cards for a in node.plugin.allocator.allocations())

    await on_node(tmp_path, 2, scenario)


async def test_a_pod_without_a_record_is_placed_by_the_nodes_best_fit(tmp_path: Path) -> None:
    first = share_pod("first", (60, 8, (1,)))
    plain = share_pod("plain", (30, 8, ()), record=False)

    def scenario(cluster: Cluster) -> None:
        node = cluster.node
        kubelet = node.kubelet
        held = kubelet.admit(first)["c0"][CORE]
        kubelet.start_container(first, "c0")
        assert placed_on(node, held) == (1,)
        plain_held = kubelet.admit(plain)["c0"][CORE]
        kubelet.start_container(plain, "c0")
        assert placed_on(node, plain_held) == (1,)  # best fit: the partly used card
        assert limits_of(node, plain_held) == contract.Limits((uuid(1),), 8 * 256 * 2**20, 30)

    await on_node(tmp_path, 2, scenario)


async def test_a_container_whose_card_is_still_held_waits_then_starts(tmp_path: Path) -> None:
    """A force-deleted pod still stopping holds the card the extender booked anew: the new
    container waits (UNAVAILABLE, kubelet retries), never lands elsewhere, never fails."""
    old = share_pod("old", (60, 40, (0,)))
    new = share_pod("new", (60, 40, (0,)))

    def scenario(cluster: Cluster) -> None:
        node = cluster.node
        kubelet = node.kubelet
        kubelet.admit(old)
        kubelet.start_container(old, "c0")
        held = kubelet.admit(new)["c0"][CORE]
        with pytest.raises(PreStartFailed) as waited:
            kubelet.start_container(new, "c0")
        assert waited.value.code is grpc.StatusCode.UNAVAILABLE
        assert "its placement record puts it on 0.60 card and 10240 MiB" in waited.value.details
        assert f"card 0 ({uuid(0)}) has 0.40 card" in waited.value.details
        assert placed_on(node, held) == ()  # not on the free card 1
        kubelet.remove(old)  # it has stopped at last
        kubelet.start_container(new, "c0")
        assert placed_on(node, held) == (0,)

    await on_node(tmp_path, 2, scenario)


async def test_the_early_verifier_places_from_the_record_before_prestart(tmp_path: Path) -> None:
    pod = share_pod("early", (20, 10, (1,)))

    def scenario(cluster: Cluster) -> None:
        node, kubelet = cluster.node, cluster.node.kubelet
        held = kubelet.admit(pod)["c0"][CORE]
        path = node.config.containers_dir / container_dir_name(held) / "limits" / "limits"
        assert kubelet.wait_for(path.exists)
        assert placed_on(node, held) == (1,)
        calls = kubelet.list_calls
        kubelet.start_container(pod, "c0")
        assert kubelet.list_calls == calls  # PreStartContainer only checked the files

    await on_node(tmp_path, 2, scenario)


@pytest.mark.parametrize("checkpoint", [True, False], ids=["checkpoint", "no-checkpoint"])
async def test_a_restart_keeps_each_card_and_directs_a_waiting_container_again(
    tmp_path: Path, checkpoint: bool
) -> None:
    holder = share_pod("holder", (60, 40, (1,)))
    waiter = share_pod("waiter", (60, 40, (1,)))

    def scenario(cluster: Cluster) -> None:
        node, kubelet = cluster.node, cluster.node.kubelet
        held = kubelet.admit(holder)["c0"][CORE]
        kubelet.start_container(holder, "c0")
        waiting = kubelet.admit(waiter)["c0"][CORE]
        with pytest.raises(PreStartFailed):
            kubelet.start_container(waiter, "c0")
        node.stop_plugin()
        if not checkpoint:  # the holder's limits file still names its card
            node.config.checkpoint_path.unlink()
        node.start_plugin()
        assert node.wait_registered()
        assert placed_on(node, held) == (1,)
        with pytest.raises(PreStartFailed) as still:
            kubelet.start_container(waiter, "c0")
        assert still.value.code is grpc.StatusCode.UNAVAILABLE
        kubelet.remove(holder)
        kubelet.start_container(waiter, "c0")
        assert placed_on(node, waiting) == (1,)

    await on_node(tmp_path, 2, scenario)


async def test_a_running_container_that_lost_its_files_is_charged_to_its_recorded_card(
    tmp_path: Path,
) -> None:
    """A restart with neither the checkpoint nor the container's limits file: the listing names
    no card, the record does (the best fit would take the free card 0)."""
    running = share_pod("running", (40, 8, (1,)))

    def scenario(cluster: Cluster) -> None:
        node, kubelet = cluster.node, cluster.node.kubelet
        held = kubelet.admit(running)["c0"][CORE]
        kubelet.start_container(running, "c0")
        node.stop_plugin()
        node.config.checkpoint_path.unlink()
        shutil.rmtree(node.config.containers_dir / container_dir_name(held))
        node.start_plugin()
        assert node.wait_registered()
        assert placed_on(node, held) == (1,)
        assert limits_of(node, held).devices == (uuid(1),)  # written back at once

    await on_node(tmp_path, 2, scenario)


async def test_an_init_container_shares_its_app_containers_record(tmp_path: Path) -> None:
    """kubelet hands an init container's IDs to the app container and lists only the app
    container: the init container runs on the card the app container's record names."""
    pod = share_pod("init", (30, 10, (1,)))
    pod.init_containers = [Container("fetch", {CORE: 30, MEMORY: 10})]

    def scenario(cluster: Cluster) -> None:
        node, kubelet = cluster.node, cluster.node.kubelet
        held = kubelet.admit(pod)
        kubelet.start_container(pod, "fetch")
        kubelet.start_container(pod, "c0")
        assert placed_on(node, held["c0"][CORE]) == (1,)
        assert set(held["fetch"][CORE]) == set(held["c0"][CORE])

    await on_node(tmp_path, 2, scenario)


# ---- the record, read for one container (no node) ---------------------------------------

CARDS = {i: Card(i, uuid(i), "Fake", 24 * GIB, i, None) for i in range(4)}
LISTED = ContainerDevices("default", "p", "main")


def api_pod(record: str | None, *, bound: str | None = NODE) -> dict[str, Any]:
    annotations = {} if record is None else {PLACEMENT_ANNOTATION: record}
    return {"metadata": {"annotations": annotations}, "spec": {"nodeName": bound}}


def record(node: str = NODE, name: str = "main", cards_: tuple[int, ...] = (2,), core: int = 30,
           memory: int = 8) -> str:  # fmt: skip
    placed = ContainerPlacement(tuple(uuid(c) for c in cards_), core, memory)
    return render(PlacementRecord(node, {name: placed}))


TARGETS = [
    pytest.param(api_pod(record()), 30, 8, (2,), id="its-card"),
    pytest.param(api_pod(record(cards_=(3, 1), core=200, memory=0)), 200, 0, (1, 3),
                 id="whole-cards-by-uuid"),
    pytest.param(api_pod(record(cards_=(0,), core=100, memory=96)), 100, 0, (0,),
                 id="whole-card-without-memory-ids"),
    pytest.param(api_pod(None), 30, 8, (), id="no-record-best-fit"),
]  # fmt: skip


@pytest.mark.parametrize(("pod", "core", "memory", "expected"), TARGETS)
def test_the_cards_a_record_directs_a_container_to(
    pod: Mapping[str, Any], core: int, memory: int, expected: tuple[int, ...]
) -> None:
    got = target_cards(pod, LISTED, node=NODE, cards=CARDS, core=core, memory=memory)
    assert got == expected


REFUSED = [
    pytest.param(api_pod(record(node="gpu-9")), RecordError,
                 "is for node 'gpu-9', not this node 'gpu-1'", id="another-node"),
    pytest.param(api_pod(record(name="side")), RecordError,
                 "places no container 'main'", id="container-not-recorded"),
    pytest.param(api_pod(record(core=40)), RecordError,
                 "books 40 core and 8 memory blocks, but kubelet allocated it 30 and 8",
                 id="amounts-differ"),
    pytest.param(api_pod(record().replace(uuid(2), "GPU-gone")), RecordError,
                 "names card(s) ['GPU-gone'] that this node does not have", id="unknown-card"),
    pytest.param(api_pod("{not json"), RecordError, "is not JSON", id="malformed"),
    pytest.param(None, RecordUnavailable, "not found in the API server", id="pod-deleted"),
    pytest.param(api_pod(record(), bound="gpu-2"), RecordUnavailable,
                 "bound to node 'gpu-2', not to this node", id="name-reused-elsewhere"),
]  # fmt: skip


@pytest.mark.parametrize(("pod", "error", "message"), REFUSED)
def test_a_record_that_cannot_place_the_container_here_says_why(
    pod: Mapping[str, Any] | None, error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as raised:
        target_cards(pod, LISTED, node=NODE, cards=CARDS, core=30, memory=8)
    assert message in str(raised.value)
