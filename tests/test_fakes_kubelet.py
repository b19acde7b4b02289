"""The fake kubelet's own shortcuts: its List is assembled as bytes, its stream checks are bulk."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from deviceplugin._proto import deviceplugin_v1beta1_pb2 as pb
from deviceplugin._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from deviceplugin._proto import podresources_v1_pb2 as pr
from deviceplugin._proto import podresources_v1_pb2_grpc as pr_grpc
from testkit.kubelet import Container, FakeKubelet, Pod, ProtocolViolation, _Resource

CORE = "fracgpu.io/core"
MEMORY = "fracgpu.io/memory"


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[FakeKubelet]:
    fake = FakeKubelet(tmp_path / "device-plugins", tmp_path / "pod-resources" / "kubelet.sock")
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture
def lister(kubelet: FakeKubelet) -> Iterator[pr_grpc.PodResourcesListerStub]:
    with grpc.insecure_channel(f"unix://{kubelet.podresources_socket}") as channel:
        yield pr_grpc.PodResourcesListerStub(channel)


def test_list_names_every_pod_and_container_with_one_entry_per_id(
    kubelet: FakeKubelet, lister: pr_grpc.PodResourcesListerStub
) -> None:
    # 2,000 IDs make lengths of several varint bytes at every level
    big = [f"g{i // 100}-c{i % 100}" for i in range(800)]
    memory = [f"GPU-{i:04d}-m{i}" for i in range(1200)]
    kubelet.allocations = {
        "ns-a/train": {"main": {CORE: big, MEMORY: memory}, "side": {CORE: ["g9-c0"]}},
        "ns-b/x": {"c": {MEMORY: ["GPU-9-m1"]}},
    }
    response = lister.List(pr.ListPodResourcesRequest(), timeout=5)
    listed = {
        (pod.namespace, pod.name, container.name): [
            (entry.resource_name, list(entry.device_ids)) for entry in container.devices
        ]
        for pod in response.pod_resources
        for container in pod.containers
    }
    assert set(listed) == {("ns-a", "train", "main"), ("ns-a", "train", "side"), ("ns-b", "x", "c")}
    main = listed[("ns-a", "train", "main")]
    assert all(len(ids) == 1 for _, ids in main)
    assert sorted(i for r, (i,) in main if r == CORE) == sorted(big)
    assert sorted(i for r, (i,) in main if r == MEMORY) == sorted(memory)
    assert listed[("ns-b", "x", "c")] == [(MEMORY, ["GPU-9-m1"])]
    assert kubelet.list_calls == 1


def test_an_empty_node_lists_nothing(
    kubelet: FakeKubelet, lister: pr_grpc.PodResourcesListerStub
) -> None:
    assert list(lister.List(pr.ListPodResourcesRequest(), timeout=5).pod_resources) == []


def test_injected_failures_are_unavailable_then_list_answers(
    kubelet: FakeKubelet, lister: pr_grpc.PodResourcesListerStub
) -> None:
    kubelet.fail_podresources(1)
    with pytest.raises(grpc.RpcError) as failed:
        lister.List(pr.ListPodResourcesRequest(), timeout=5)
    assert failed.value.code() is grpc.StatusCode.UNAVAILABLE
    lister.List(pr.ListPodResourcesRequest(), timeout=5)


def test_get_is_unimplemented_as_on_a_kubelet_without_it(
    lister: pr_grpc.PodResourcesListerStub,
) -> None:
    with pytest.raises(grpc.RpcError) as failed:
        lister.Get(pr.GetPodResourcesRequest(pod_name="x", pod_namespace="y"), timeout=5)
    assert failed.value.code() is grpc.StatusCode.UNIMPLEMENTED


def _resource() -> _Resource:
    channel = grpc.insecure_channel("unix:///nonexistent")
    stub = pb_grpc.DevicePluginStub(channel)
    return _Resource(CORE, "p.sock", pb.DevicePluginOptions(), channel, stub)


@pytest.mark.parametrize(
    ("devices", "violation"),
    [
        pytest.param([("g0-c0", "Healthy"), ("g0-c1", "Unhealthy")], None, id="valid"),
        pytest.param([("", "Healthy")], "is not 1–63 chars", id="empty-id"),
        pytest.param([("x" * 64, "Healthy")], "is not 1–63 chars", id="id-of-64-chars"),
        pytest.param(
            [("g0-c0", "Healthy"), ("g0-c0", "Healthy")], "listed twice", id="id-listed-twice"
        ),
        pytest.param([("g0-c0", "healthy")], "health 'healthy'", id="lower-case-health"),
    ],
)
def test_listandwatch_messages_are_checked_as_kubelet_would(
    kubelet: FakeKubelet, devices: list[tuple[str, str]], violation: str | None
) -> None:
    resource = _resource()
    message = pb.ListAndWatchResponse(devices=[pb.Device(ID=i, health=h) for i, h in devices])
    if violation is None:
        kubelet._accept_list(resource, message)
        assert resource.devices == dict(devices)
        assert resource.messages == 1
        assert kubelet.history[-1][2] == 1
    else:
        with pytest.raises(ProtocolViolation, match=violation):
            kubelet._accept_list(resource, message)
        assert resource.messages == 0
    resource.channel.close()


def test_empty_listings_answer_no_pods_then_list_again(
    kubelet: FakeKubelet, lister: pr_grpc.PodResourcesListerStub
) -> None:
    kubelet.allocations = {"ns/p": {"c": {CORE: ["g0-c1"]}}}
    kubelet.empty_listings(2)
    counts = [
        len(lister.List(pr.ListPodResourcesRequest(), timeout=5).pod_resources) for _ in "abc"
    ]
    assert counts == [0, 0, 1]


def test_plain_init_containers_are_not_listed(
    kubelet: FakeKubelet, lister: pr_grpc.PodResourcesListerStub
) -> None:
    """kubelet lists app containers (and sidecars) only; an init container's IDs show under the
    app container that reuses them."""
    kubelet.allocations = {"ns/p": {"init": {CORE: ["g0-c1"]}, "app": {CORE: ["g0-c1"]}}}
    kubelet.init_names = {"ns/p": {"init"}}
    response = lister.List(pr.ListPodResourcesRequest(), timeout=5)
    names = [c.name for pod in response.pod_resources for c in pod.containers]
    assert names == ["app"]


def test_schedulable_is_allocatable_minus_what_is_held(kubelet: FakeKubelet) -> None:
    resource = _resource()
    kubelet.resources[CORE] = resource
    kubelet._accept_list(
        resource,
        pb.ListAndWatchResponse(
            devices=[pb.Device(ID=f"g0-c{n}", health="Healthy") for n in range(3)]
            + [pb.Device(ID="g0-c3", health="Unhealthy")]
        ),
    )
    kubelet.allocations = {"ns/held": {"c": {CORE: ["g0-c0"]}}}
    fits = Pod("ns", "two", [Container("c", {CORE: 2})])
    too_big = Pod("ns", "three", [Container("c", {CORE: 3})])
    init_bigger = Pod("ns", "init", [Container("c", {CORE: 1})], [Container("i", {CORE: 3})])
    assert kubelet.schedulable(fits)
    assert not kubelet.schedulable(too_big)
    assert not kubelet.schedulable(init_bigger)
    resource.channel.close()
