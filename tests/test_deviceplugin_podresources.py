"""Reading kubelet's PodResources listing, which has one ContainerDevices entry per device ID."""

from __future__ import annotations

from deviceplugin._proto import podresources_v1_pb2 as pr
from deviceplugin.podresources import find, merge

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
