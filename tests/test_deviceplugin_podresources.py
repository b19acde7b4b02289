"""Reading kubelet's PodResources listing, which has one ContainerDevices entry per device ID."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from deviceplugin._proto import podresources_v1_pb2 as pr
from deviceplugin.shared.podresources import PodResourcesClient, PodResourcesError, find, merge
from testkit.kubelet import FakeKubelet

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
    assert found is not None
    assert found.name == "ns/p/b"
    assert found.ids(CORE) == {"g0-c3"}
    assert find(response, CORE, frozenset({"g0-c1"}), OURS) is None  # a subset is not a holder
    assert find(response, CORE, frozenset({"g9-c1"}), OURS) is None


@pytest.fixture
def served(tmp_path: Path) -> Iterator[FakeKubelet]:
    kubelet = FakeKubelet(tmp_path / "device-plugins", tmp_path / "pod-resources" / "kubelet.sock")
    kubelet.start()
    kubelet.allocations = {"ns/p": {"c": {CORE: ["g0-c1"], MEMORY: ["g0-m0"]}}}
    yield kubelet
    kubelet.stop()


@pytest.fixture
def dialled(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    targets: list[str] = []
    dial = grpc.insecure_channel

    def counting(target: str) -> grpc.Channel:
        targets.append(target)
        return dial(target)

    monkeypatch.setattr(grpc, "insecure_channel", counting)
    return targets


def test_client_dials_once_for_concurrent_callers_and_again_after_a_failure(
    served: FakeKubelet, dialled: list[str]
) -> None:
    client = PodResourcesClient(served.podresources_socket, timeout_s=5)
    wanted = frozenset({"g0-c1"})
    with ThreadPoolExecutor(8) as pool:  # first use from several handlers at once
        found = list(pool.map(lambda _: client.find(CORE, wanted, OURS), range(8)))
    assert all(c is not None and c.name == "ns/p/c" for c in found)
    assert len(dialled) == 1
    served.fail_podresources(1)
    with pytest.raises(PodResourcesError, match="UNAVAILABLE"):
        client.list(OURS)
    assert [c.name for c in client.list(OURS)] == ["ns/p/c"]
    assert len(dialled) == 2
    # a kubelet restart (a new socket file) is survived: gRPC reconnects to the path
    served.stop()
    served.start()
    answers = []
    for _ in range(3):
        try:
            answers.append([c.name for c in client.list(OURS)])
        except PodResourcesError:
            answers.append(None)
    assert answers[-1] == ["ns/p/c"]
    client.close()
    assert client._connected is None


def test_a_failure_closes_only_the_channel_it_happened_on(served: FakeKubelet) -> None:
    client = PodResourcesClient(served.podresources_socket, timeout_s=5)
    old, _ = client._connection()
    client.close()
    new, _ = client._connection()
    client._forget(old)  # a late failure on the old channel
    assert client._connection()[0] is new
    assert [c.name for c in client.list(OURS)] == ["ns/p/c"]
    client.close()


def test_a_call_on_a_channel_closed_under_it_is_a_transient_error(
    served: FakeKubelet, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = PodResourcesClient(served.podresources_socket, timeout_s=5)
    stale = client._connection()
    client.close()  # another caller's failure, or the plugin stopping
    monkeypatch.setattr(client, "_connection", lambda: stale)
    with pytest.raises(PodResourcesError, match="closed"):
        client.find(CORE, frozenset({"g0-c1"}), OURS)
