"""The node guard in DRA mode: a claim is the grant, found through kubelet's PodResources
(``dynamic_resources``) and the plugin's prepared claims; containers sharing a claim are held
to it together, as the hook holds them (one accounting region per claim)."""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from deviceplugin._proto import podresources_v1_pb2 as pr
from deviceplugin._proto import podresources_v1_pb2_grpc as pr_grpc
from deviceplugin.shared.guardowners import GrantError
from deviceplugin.shared.podresources import ContainerDevices, merge
from deviceplugin.shared.settings import GuardSettings
from testkit.dranode import DRIVER, DraNode, dra_node, share_claim
from testkit.nodeproc import FakeContainer, NodeProc, container

TRAIN = container("default", "train-0", "main")
SIDECAR = container("default", "train-0", "sidecar")
OTHER = container("default", "other-0", "main")


class PodResources(pr_grpc.PodResourcesListerServicer):
    """kubelet's PodResources List, as much of it as the guard reads: containers and the
    claims (namespace, name, driver) they use."""

    def __init__(self) -> None:
        self.uses: dict[FakeContainer, list[tuple[str, str]]] = {}

    def List(self, request: Any, context: Any) -> pr.ListPodResourcesResponse:
        pods: dict[tuple[str, str], pr.PodResources] = {}
        for target, claims in self.uses.items():
            pod = pods.setdefault(
                (target.namespace, target.pod),
                pr.PodResources(name=target.pod, namespace=target.namespace),
            )
            pod.containers.append(
                pr.ContainerResources(
                    name=target.container,
                    dynamic_resources=[
                        pr.DynamicResource(
                            claim_name=name,
                            claim_namespace="default",
                            claim_resources=[pr.ClaimResource(driver_name=driver)],
                        )
                        for name, driver in claims
                    ],
                )
            )
        return pr.ListPodResourcesResponse(pod_resources=list(pods.values()))


@pytest.fixture
def kubelet_podresources() -> Iterator[tuple[PodResources, Path]]:
    root = Path(tempfile.mkdtemp(prefix="pr", dir="/tmp"))
    socket = root / "kubelet.sock"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    service = PodResources()
    pr_grpc.add_PodResourcesListerServicer_to_server(service, server)
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    try:
        yield service, socket
    finally:
        server.stop(0)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[NodeProc]:
    node = NodeProc(tmp_path / "node")
    try:
        yield node
    finally:
        node.close()


async def _killed(child: Any, within_s: float = 3.0) -> bool:
    deadline = time.monotonic() + within_s
    while child.poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110 - no event
        await asyncio.sleep(0.02)
    return child.poll() is not None


async def _start(node: DraNode, socket: Path, procs: NodeProc) -> None:
    guard = GuardSettings(
        interval_s=0.05,
        grace_s=0.1,
        process_overhead_mib=0,
        proc_root=procs.proc,
        container_logs=procs.logs,
    )
    await node.start_plugin(guard=guard, podresources_socket=socket)
    assert await node.wait_registered()
    await node.wait_slice()


async def _prepare(node: DraNode, name: str, memory: str) -> None:
    node.create_claim(share_claim(name, cores=30, memory=memory))
    claim = node.allocate(name)
    assert node.kubelet is not None
    await node.kubelet.prepare(DRIVER, [node.key(claim)])


def test_podresources_names_the_drivers_claims_per_container() -> None:
    response = pr.ListPodResourcesResponse(
        pod_resources=[
            pr.PodResources(
                name="p",
                namespace="ns",
                containers=[
                    pr.ContainerResources(
                        name="ours",
                        dynamic_resources=[
                            pr.DynamicResource(
                                claim_name="c1",
                                claim_namespace="ns",
                                claim_resources=[pr.ClaimResource(driver_name=DRIVER)],
                            ),
                            pr.DynamicResource(
                                claim_name="nic",
                                claim_namespace="ns",
                                claim_resources=[pr.ClaimResource(driver_name="net.example.com")],
                            ),
                        ],
                    ),
                    pr.ContainerResources(name="no-gpu"),
                ],
            )
        ]
    )
    assert merge(response, set(), DRIVER) == [
        ContainerDevices("ns", "p", "ours", {}, frozenset({("ns", "c1")}))
    ]
    assert merge(response, set()) == []  # device-plugin mode reads no claims


async def test_a_process_over_its_claims_memory_is_killed(
    kubelet_podresources: tuple[PodResources, Path], procs: NodeProc
) -> None:
    service, socket = kubelet_podresources
    async with dra_node(1, 8192, start=False) as node:
        await _start(node, socket, procs)
        await _prepare(node, "train", "2Gi")
        service.uses[TRAIN] = [("train", DRIVER)]
        child = procs.spawn()
        procs.enter(child.pid, TRAIN)
        node.nvml.process(0, child.pid, 2048)
        node.nvml.busy(0, child.pid, 40)
        await asyncio.sleep(0.4)
        assert child.poll() is None  # exactly its claim
        share = {
            "namespace": "default",
            "pod": "train-0",
            "container": "main",
            "card_uuid": node.plugin.driver.cards[0].uuid,  # type: ignore[union-attr]
            "model": node.plugin.driver.cards[0].product,  # type: ignore[union-attr]
        }
        registry = node.plugin.metrics.registry
        used = registry.get_sample_value("fracgpu_dra_plugin_share_memory_used_bytes", share)
        granted = registry.get_sample_value("fracgpu_dra_plugin_share_memory_granted_bytes", share)
        assert (used, granted) == (2048 * 2**20, 2 * 2**30)
        busy = registry.get_sample_value("fracgpu_dra_plugin_share_compute_used_percent", share)
        assert busy == 40
        node.nvml.process(0, child.pid, 2049)
        assert await _killed(child)
        metrics = node.plugin.metrics.registry
        assert metrics.get_sample_value("fracgpu_dra_plugin_guard_kills_total", {"card": "0"}) == 1


async def test_containers_sharing_a_claim_are_held_to_it_together(
    kubelet_podresources: tuple[PodResources, Path], procs: NodeProc
) -> None:
    """Each of the two holds 1.5 GiB, within the 2 GiB claim on its own, 3 GiB together: the
    larger process is killed and the rest fits."""
    service, socket = kubelet_podresources
    async with dra_node(1, 8192, start=False) as node:
        await _start(node, socket, procs)
        await _prepare(node, "shared", "2Gi")
        service.uses[TRAIN] = [("shared", DRIVER)]
        service.uses[SIDECAR] = [("shared", DRIVER)]
        first, second = procs.spawn(), procs.spawn()
        procs.enter(first.pid, TRAIN)
        procs.enter(second.pid, SIDECAR)
        node.nvml.process(0, first.pid, 1024)
        node.nvml.process(0, second.pid, 1536)
        assert await _killed(second)
        assert first.poll() is None


async def test_a_container_of_no_claim_of_ours_is_never_acted_on(
    kubelet_podresources: tuple[PodResources, Path], procs: NodeProc
) -> None:
    service, socket = kubelet_podresources
    async with dra_node(1, 8192, start=False) as node:
        await _start(node, socket, procs)
        service.uses[OTHER] = [("nic", "net.example.com")]
        child = procs.spawn()
        procs.enter(child.pid, OTHER)
        node.nvml.process(0, child.pid, 8000)
        await asyncio.sleep(0.5)
        assert child.poll() is None
        metrics = node.plugin.metrics.registry
        foreign = metrics.get_sample_value(
            "fracgpu_dra_plugin_guard_foreign_processes", {"card": "0"}
        )
        assert foreign == 1


async def test_a_claim_not_prepared_here_is_no_grant(tmp_path: Path) -> None:
    async with dra_node(1, 8192) as node:
        listed = ContainerDevices("default", "p", "c", {}, frozenset({("default", "nowhere")}))
        with pytest.raises(GrantError, match="not prepared on this node"):
            node.plugin.driver.grant_dir(listed)  # type: ignore[union-attr]
        two = dataclasses.replace(listed, claims=frozenset({("default", "a"), ("default", "b")}))
        with pytest.raises(GrantError, match="exactly one"):
            node.plugin.driver.grant_dir(two)  # type: ignore[union-attr]
