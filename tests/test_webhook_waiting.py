"""webhook/waiting.py: a waiting GPU pod told, in cards and MiB, what it asks and what is free."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import pytest

from core import dra
from core.kube import kube_client
from core.labels import FREE_ANNOTATION
from testkit.apiserver import DEFAULT_NAMESPACES, FakeApiServer
from tests.support import eventually
from webhook.waiting import (
    CardNeed,
    FreeCard,
    asks_of,
    asks_of_pod,
    explain,
    free_cards,
    free_cards_of_nodes,
    waits_for_gpu,
    waits_for_share,
)
from webhook.waitwatch import WaitExplainer

GIB = 1024


def _slice(node: str, cards: int, memory: str = "24Gi") -> dict[str, Any]:
    return {
        "spec": {
            "driver": dra.DRIVER,
            "nodeName": node,
            "pool": {"name": node},
            "devices": [
                {
                    "name": f"gpu-{i}",
                    "capacity": {dra.CORES: {"value": "100"}, dra.MEMORY: {"value": memory}},
                }
                for i in range(cards)
            ],
        }
    }


def _claim(node: str, device: str, cores: str, memory: str) -> dict[str, Any]:
    result = {
        "driver": dra.DRIVER,
        "pool": node,
        "device": device,
        "consumedCapacity": {dra.CORES: cores, dra.MEMORY: memory},
    }
    return {"status": {"allocation": {"devices": {"results": [result]}}}}


def _whole(count: int) -> dict[str, Any]:
    request = {"exactly": {"deviceClassName": dra.DEVICE_CLASS, "count": count}}
    return {"devices": {"requests": [request]}}


def _share(cores: str, memory: str) -> dict[str, Any]:
    return {
        "devices": {
            "requests": [
                {
                    "name": "gpu",
                    "exactly": {
                        "deviceClassName": dra.DEVICE_CLASS,
                        "capacity": {"requests": {dra.CORES: cores, dra.MEMORY: memory}},
                    },
                }
            ]
        }
    }


def test_free_capacity_is_what_allocated_shares_left() -> None:
    slices = [_slice("node-a", 2)]
    claims = [_claim("node-a", "gpu-0", "60", "10Gi"), _claim("node-a", "gpu-0", "30", "8Gi")]
    assert free_cards(slices, claims) == [
        FreeCard(10, 6 * GIB, "node-a", "gpu-0"),
        FreeCard(100, 24 * GIB, "node-a", "gpu-1"),
    ]


def test_another_drivers_devices_and_results_do_not_count() -> None:
    other = _slice("node-a", 1)
    other["spec"]["driver"] = "gpu.nvidia.com"
    claim = _claim("node-a", "gpu-0", "100", "24Gi")
    claim["status"]["allocation"]["devices"]["results"][0]["driver"] = "gpu.nvidia.com"
    assert free_cards([other, _slice("node-a", 1)], [claim]) == [
        FreeCard(100, 24 * GIB, "node-a", "gpu-0")
    ]


@pytest.mark.parametrize(
    ("spec", "asks"),
    [
        pytest.param(_share("50", "8Gi"), [CardNeed(50, 8 * GIB)], id="a share"),
        pytest.param(
            {
                "devices": {
                    "requests": [{"exactly": {"deviceClassName": dra.DEVICE_CLASS, "count": 2}}]
                }
            },
            [CardNeed(cards=2)],
            id="whole cards",
        ),
        pytest.param(
            {
                "devices": {
                    "requests": [
                        {
                            "firstAvailable": [
                                {
                                    "deviceClassName": dra.DEVICE_CLASS,
                                    "capacity": {"requests": {"cores": "25", "memory": "20Gi"}},
                                },
                                {
                                    "deviceClassName": dra.DEVICE_CLASS,
                                    "capacity": {"requests": {"cores": "25", "memory": "6Gi"}},
                                },
                            ]
                        }
                    ]
                }
            },
            [CardNeed(25, 6 * GIB)],
            id="the smallest alternative",
        ),
        pytest.param(
            {
                "devices": {
                    "requests": [
                        {
                            "exactly": {
                                "deviceClassName": dra.DEVICE_CLASS,
                                "count": 2,
                                "capacity": {"requests": {"cores": "30", "memory": "8192Mi"}},
                            }
                        }
                    ]
                }
            },
            [CardNeed(30, 8 * GIB, count=2)],
            id="a share of two cards",
        ),
        pytest.param(
            {"devices": {"requests": [{"exactly": {"deviceClassName": "other", "count": 1}}]}},
            [],
            id="another class",
        ),
    ],
)
def test_what_a_claim_asks(spec: dict[str, Any], asks: list[CardNeed]) -> None:
    assert asks_of(spec) == asks


@pytest.mark.parametrize(
    ("asks", "free", "message"),
    [
        pytest.param(
            [CardNeed(50, 8 * GIB)],
            [FreeCard(40, 12 * GIB, "node-a", "gpu-1"), FreeCard(40, 4 * GIB, "node-b", "gpu-0")],
            "largest free share on any node: 0.40 card and 12288 MiB on gpu-1 of node-a; "
            "this pod asks 0.50 card and 8192 MiB",
            id="fragmented",
        ),
        pytest.param(
            [CardNeed(cards=2)],
            [FreeCard(100, 24 * GIB, "a", "gpu-0"), FreeCard(100, 24 * GIB, "b", "gpu-0")],
            "whole cards free on the cluster: 2, at most 1 on one node; "
            "this pod asks 2 whole cards",
            id="whole cards spread over nodes",
        ),
        pytest.param(
            [CardNeed(30, 8 * GIB, count=2)],
            [
                FreeCard(40, 12 * GIB, "node-a", "gpu-0"),
                FreeCard(20, 12 * GIB, "node-a", "gpu-1"),
                FreeCard(30, 8 * GIB, "node-b", "gpu-0"),
                FreeCard(30, 4 * GIB, "node-b", "gpu-1"),
            ],
            "cards of one node that could each take 0.30 card and 8192 MiB: at most 1 "
            "(on node-b); this pod asks 0.30 card and 8192 MiB on each of 2 cards",
            id="a share of two cards: one card per node has room",
        ),
        pytest.param(
            [CardNeed(30, 8 * GIB, count=2)],
            [FreeCard(10, 12 * GIB, "node-a", "gpu-0")],
            "cards of one node that could each take 0.30 card and 8192 MiB: at most 0; "
            "this pod asks 0.30 card and 8192 MiB on each of 2 cards",
            id="a share of two cards: no card has room",
        ),
        pytest.param(
            [CardNeed(50, 8 * GIB)],
            [],
            "no node publishes fracgpu GPUs (no ResourceSlice of gpu.fracgpu.io); this pod asks "
            "0.50 card and 8192 MiB; check that fracgpu dra-plugin runs on the GPU nodes",
            id="no slice",
        ),
    ],
)
def test_explanations(asks: list[CardNeed], free: list[FreeCard], message: str) -> None:
    assert explain(asks, free) == message


@pytest.mark.parametrize(
    ("status", "waits"),
    [
        pytest.param(
            {
                "phase": "Pending",
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/1 nodes are available: 1 cannot allocate all claims.",
                    }
                ],
            },
            True,
            id="the scheduler's no-fit condition",
        ),
        pytest.param({"phase": "Pending"}, False, id="not looked at yet"),
        pytest.param(
            {
                "phase": "Pending",
                "conditions": [
                    {"type": "PodScheduled", "status": "False", "message": "Insufficient cpu"}
                ],
            },
            False,
            id="waits for something else",
        ),
        pytest.param({"phase": "Running"}, False, id="running"),
    ],
)
def test_which_pods_wait_for_a_card(status: dict[str, Any], waits: bool) -> None:
    assert waits_for_gpu({"status": status}) is waits


# --- the explainer, against the fake API server ------------------------------------------------


def _waiting_pod(name: str, claim: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "team-a", "uid": f"uid-{name}"},
        "spec": {"containers": [{"name": "c", "image": "x"}]},
        "status": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/1 nodes are available: 1 cannot allocate all claims.",
                }
            ],
            "resourceClaimStatuses": [{"name": "gpu-0", "resourceClaimName": claim}],
        },
    }


def _claim_object(name: str, spec: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "team-a"},
        "spec": spec,
        "status": status,
    }


async def test_a_waiting_pod_gets_one_event_per_explanation(tmp_path: Path) -> None:
    async with (
        FakeApiServer(namespaces=(*DEFAULT_NAMESPACES, "team-a")) as fake,
        kube_client(fake.kubeconfig(tmp_path / "kubeconfig")) as api,
    ):
        fake.put(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceSlice",
                "metadata": {"name": "node-a-gpu"},
                **_slice("node-a", 1),
            }
        )
        held = _claim("node-a", "gpu-0", "60", "20Gi")["status"]
        fake.put(_claim_object("running-gpu-0", _share("60", "20Gi"), held))
        fake.put(_claim_object("waiting-gpu-0", _share("50", "8Gi"), {}))
        fake.put(_waiting_pod("waiting", "waiting-gpu-0"))
        explainer = WaitExplainer(api, interval_s=0.05)
        task = asyncio.create_task(explainer.run())
        try:
            await eventually(lambda: len(fake.objects("events", "team-a")) == 1)
            await asyncio.sleep(0.2)  # more passes, same explanation: no second event
            [event] = fake.objects("events", "team-a")
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert event["involvedObject"]["name"] == "waiting"
    assert event["reason"] == "GPUShareDoesNotFit"
    assert event["message"] == (
        "largest free share on any node: 0.40 card and 4096 MiB on gpu-0 of node-a; "
        "this pod asks 0.50 card and 8192 MiB"
    )


# --- device-plugin mode: what each node's plugin publishes free, and the pod's own limits -------


def _gpu_node(name: str, cards: list[tuple[int, int]], *, raw: str | None = None) -> dict[str, Any]:
    document = {
        "version": 1,
        "cards": [{"index": i, "cores": c, "memoryMiB": m} for i, (c, m) in enumerate(cards)],
    }
    text = raw if raw is not None else json.dumps(document)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "annotations": {FREE_ANNOTATION: text}},
    }


@pytest.mark.parametrize(
    ("nodes", "free"),
    [
        pytest.param(
            [_gpu_node("a", [(40, 12288), (0, 0)])],
            [FreeCard(40, 12288, "a", "card 0"), FreeCard(0, 0, "a", "card 1")],
            id="each card of a node",
        ),
        pytest.param([{"metadata": {"name": "cpu"}}], [], id="a node without the annotation"),
        pytest.param([_gpu_node("a", [], raw="{")], [], id="unreadable: left out"),
        pytest.param(
            [_gpu_node("a", [], raw='{"version": 7, "cards": []}')], [], id="other version"
        ),
        pytest.param([_gpu_node("a", [], raw='{"version": 1, "cards": [{}]}')], [], id="bad card"),
    ],
)
def test_free_cards_of_nodes(nodes: list[dict[str, Any]], free: list[FreeCard]) -> None:
    assert free_cards_of_nodes(nodes) == free


def _dp_pod(*limits: dict[str, str], message: str = "0/1 nodes are available: 1 Insufficient "
            "fracgpu.io/core.") -> dict[str, Any]:  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "waiting", "namespace": "team-a", "uid": "uid-waiting"},
        "spec": {
            "containers": [
                {"name": f"c{i}", "image": "x", "resources": {"limits": lim}}
                for i, lim in enumerate(limits)
            ]
        },
        "status": {
            "phase": "Pending",
            "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": message}
            ],
        },
    }  # fmt: skip


@pytest.mark.parametrize(
    ("pod", "asks"),
    [
        pytest.param(
            _dp_pod({"fracgpu.io/core": "50", "fracgpu.io/memory": "32"}),
            [CardNeed(cores=50, memory_mib=8192)],
            id="a share",
        ),
        pytest.param(_dp_pod({"fracgpu.io/core": "200"}), [CardNeed(cards=2)], id="whole cards"),
        pytest.param(
            _dp_pod({"cpu": "1"}, {"fracgpu.io/core": "100"}), [CardNeed(cards=1)], id="mixed"
        ),
        pytest.param(_dp_pod({"fracgpu.io/core": "bad"}), [], id="unreadable: none"),
    ],
)
def test_what_a_device_plugin_pod_asks(pod: dict[str, Any], asks: list[CardNeed]) -> None:
    assert asks_of_pod(pod) == asks


@pytest.mark.parametrize(
    ("message", "waits"),
    [
        pytest.param("0/1 nodes are available: 1 Insufficient fracgpu.io/core.", True, id="core"),
        pytest.param("0/2 nodes are available: 2 Insufficient fracgpu.io/memory.", True, id="mem"),
        pytest.param("0/1 nodes are available: 1 Insufficient cpu.", False, id="cpu"),
    ],
)
def test_which_device_plugin_pods_wait_for_a_card(message: str, waits: bool) -> None:
    assert waits_for_share(_dp_pod({"fracgpu.io/core": "50"}, message=message)) is waits


def test_a_device_plugin_explanation_with_no_node_publishing() -> None:
    assert explain([CardNeed(cores=50, memory_mib=8192)], [], device_plugin=True) == (
        f"no node publishes what its cards have free (Node annotation {FREE_ANNOTATION}); this "
        "pod asks 0.50 card and 8192 MiB; check that fracgpu device-plugin runs on the GPU nodes "
        "with --node-name"
    )


async def test_a_waiting_device_plugin_pod_gets_an_event(tmp_path: Path) -> None:
    async with (
        FakeApiServer(namespaces=(*DEFAULT_NAMESPACES, "team-a")) as fake,
        kube_client(fake.kubeconfig(tmp_path / "kubeconfig")) as api,
    ):
        fake.put(_gpu_node("node-a", [(40, 12288), (30, 20480)]))
        fake.put(_dp_pod({"fracgpu.io/core": "50", "fracgpu.io/memory": "32"}))
        explainer = WaitExplainer(api, interval_s=0.05, device_plugin=True)
        task = asyncio.create_task(explainer.run())
        try:
            await eventually(lambda: len(fake.objects("events", "team-a")) == 1)
            [event] = fake.objects("events", "team-a")
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert event["reason"] == "GPUShareDoesNotFit"
    assert event["message"] == (
        "largest free share on any node: 0.40 card and 12288 MiB on card 0 of node-a; "
        "this pod asks 0.50 card and 8192 MiB"
    )
