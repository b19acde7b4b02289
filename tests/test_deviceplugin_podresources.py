"""Reading kubelet's PodResources listing, which has one ContainerDevices entry per device ID."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from deviceplugin._proto import podresources_v1_pb2 as pr
from deviceplugin.podresources import PodResourcesClient, PodResourcesError, find, merge
from tests.fakes.kubelet import FakeKubelet

CORE = "fracgpu.io/core"
MEMORY = "fracgpu.io/memory"
OURS = {CORE, MEMORY}


def listing(*containers: tuple[str, dict[str, list[str]]]) -> pr.ListPodResourcesResponse:
    response = pr.ListPodResourcesResponse()
    pod = response.pod_resources.add(name="p", namespace="ns")
    for name, held in containers:
        container = pod.containers.add(name=name)
        for resource, ids in held.items():
            for device in ids:
                container.devices.add(resource_name=resource, device_ids=[device])
    return response


def test_merge_joins_entries_by_resource_and_skips_other_resources() -> None:
    response = listing(
        ("a", {CORE: ["g0-c1", "g0-c2"], MEMORY: ["g0-m0"], "nvidia.com/gpu": ["x"]}),
        ("plain", {"example.com/nic": ["n0"]}),
    )
    (container,) = merge(response, OURS)
    assert container.name == "ns/p/a"
    assert container.devices == {
        CORE: frozenset({"g0-c1", "g0-c2"}),
        MEMORY: frozenset({"g0-m0"}),
    }


def test_find_returns_only_an_exact_holder() -> None:
    response = listing(
        ("a", {CORE: ["g0-c1", "g0-c2"], MEMORY: ["g0-m0"]}),
        ("b", {CORE: ["g0-c3"], MEMORY: ["g0-m1", "g0-m2"]}),
    )
    found = find(response, MEMORY, frozenset({"g0-m1", "g0-m2"}), OURS)
    assert found is not None and found.name == "ns/p/b"
    assert found.ids(CORE) == {"g0-c3"}
    assert find(response, CORE, frozenset({"g0-c1"}), OURS) is None  # a subset is not a holder
    assert find(response, CORE, frozenset({"g9-c1"}), OURS) is None


def test_client_shares_one_channel_and_dials_again_after_kubelet_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dialled: list[str] = []
    dial = grpc.insecure_channel

    def counting(target: str) -> grpc.Channel:
        dialled.append(target)
        return dial(target)

    monkeypatch.setattr(grpc, "insecure_channel", counting)
    kubelet = FakeKubelet(tmp_path / "device-plugins", tmp_path / "pod-resources" / "kubelet.sock")
    kubelet.start()
    kubelet.allocations = {"ns/p": {"c": {CORE: ["g0-c1"], MEMORY: ["g0-m0"]}}}
    client = PodResourcesClient(kubelet.podresources_socket, timeout_s=5)
    try:
        with ThreadPoolExecutor(8) as pool:  # first use from several handlers at once
            found = list(
                pool.map(lambda _: client.find(CORE, frozenset({"g0-c1"}), OURS), range(8))
            )
        assert all(c is not None and c.name == "ns/p/c" for c in found)
        first = client._channel
        assert first is not None
        # kubelet restarts: its PodResources socket is a new file
        kubelet.stop()
        kubelet.start()
        answers = []
        for _ in range(3):
            try:
                answers.append(client.list(OURS))
            except PodResourcesError:
                answers.append(None)  # the old connection's failure, reported as transient
        assert answers[-1] is not None and [c.name for c in answers[-1]] == ["ns/p/c"]
        assert len(dialled) == 1 + answers.count(None)
    finally:
        client.close()
        kubelet.stop()
    assert client._channel is None
