"""The fake API server's resource.k8s.io/v1: what a 1.36 server accepted, refused, rewrote and
allocated (the scheduling cases are the ones observed on a real cluster)."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from core.kube import RESOURCE_CLAIMS, RESOURCE_SLICES, KubeInvalid, call_json
from testkit.apiserver import FakeApiServer
from testkit.dranode import device_class, share_claim
from testkit.draobjects import Unschedulable, allocate_claim, canonical_quantity

GIB = 2**30


def gpu(index: int, *, memory: str = "81920Mi", **extra: Any) -> dict[str, Any]:
    return {
        "name": f"gpu-{index}",
        "allowMultipleAllocations": True,
        "attributes": {
            "index": {"int": index},
            "productName": {"string": "NVIDIA H100 80GB HBM3"},
            "uuid": {"string": f"GPU-{index:08d}-0000-0000-0000-000000000000"},
        },
        "capacity": {
            "cores": {
                "value": "100",
                "requestPolicy": {
                    "default": "100",
                    "validRange": {"min": "1", "max": "100", "step": "1"},
                },
            },
            "memory": {
                "value": memory,
                "requestPolicy": {
                    "default": memory,
                    "validRange": {"min": "256Mi", "step": "256Mi"},
                },
            },
        },
        **extra,
    }


def resource_slice(node: str = "node-a", devices: list[Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-gpu.fracgpu.io"},
        "spec": {
            "driver": "gpu.fracgpu.io",
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices if devices is not None else [gpu(0), gpu(1)],
        },
    }


@pytest.fixture
async def server() -> AsyncIterator[tuple[FakeApiServer, Any]]:
    async with FakeApiServer() as fake, fake.api_client() as api:
        yield fake, api


def _edit(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    obj = resource_slice()
    change(obj)
    return obj


def _device(index: int, change: Callable[[dict[str, Any]], None]) -> Callable[[Any], None]:
    def apply(obj: dict[str, Any]) -> None:
        change(obj["spec"]["devices"][index])

    return apply


async def test_the_observed_slice_is_accepted_and_its_quantities_re_serialised(
    server: tuple[FakeApiServer, Any],
) -> None:
    _, api = server
    stored = await call_json(api, "POST", RESOURCE_SLICES.path(), body=resource_slice())
    memory = stored["spec"]["devices"][0]["capacity"]["memory"]
    assert memory["value"] == "80Gi"
    assert memory["requestPolicy"]["default"] == "80Gi"
    assert memory["requestPolicy"]["validRange"] == {"min": "256Mi", "step": "256Mi"}


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        pytest.param("81920Mi", "80Gi", id="binary-folds-up"),
        pytest.param("81408Mi", "81408Mi", id="binary-not-a-whole-gi"),
        pytest.param("100", "100", id="decimal-small"),
        pytest.param("1000", "1k", id="decimal-folds-up"),
        pytest.param("0.5", "500m", id="fraction-in-milli"),
        pytest.param(85899345920, "85899345920", id="plain-bytes-stay-decimal"),
    ],
)
def test_canonical_quantities(raw: Any, canonical: str) -> None:
    assert canonical_quantity(raw) == canonical


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(obj: dict[str, Any]) -> None:
        target = obj
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return apply


def _drop(path: list[Any]) -> Callable[[dict[str, Any]], None]:
    def apply(obj: dict[str, Any]) -> None:
        target = obj
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return apply


POLICY = ["capacity", "memory", "requestPolicy"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        pytest.param(_set(["spec", "driver"], "Bad_Driver"), "spec.driver", id="driver-name"),
        pytest.param(_drop(["spec", "nodeName"]), "spec", id="no-node-selection"),
        pytest.param(_set(["spec", "allNodes"], True), "spec", id="two-node-selections"),
        pytest.param(
            _set(["spec", "pool", "resourceSliceCount"], 0),
            "spec.pool.resourceSliceCount",
            id="slice-count-zero",
        ),
        pytest.param(
            _device(0, _set(["name"], "GPU_0")), "spec.devices[0].name", id="device-name-label"
        ),
        pytest.param(
            _device(1, _set(["name"], "gpu-0")), "spec.devices[1].name", id="device-name-dup"
        ),
        pytest.param(
            _device(0, _set(["attributes", "uuid"], {"string": "x" * 65})),
            "spec.devices[0].attributes[uuid].string",
            id="string-attribute-too-long",
        ),
        pytest.param(
            _device(0, _set(["attributes", "index"], {"int": 1, "string": "1"})),
            "spec.devices[0].attributes[index]",
            id="attribute-two-values",
        ),
        pytest.param(
            _device(0, _set(["allowMultipleAllocations"], False)),
            "spec.devices[0].capacity[cores].requestPolicy",
            id="policy-without-multiple-allocations",
        ),
        pytest.param(
            _device(0, _drop([*POLICY, "default"])),
            "spec.devices[0].capacity[memory].requestPolicy.default",
            id="range-without-default",
        ),
        pytest.param(
            _device(0, _set([*POLICY, "default"], "300Mi")),
            "spec.devices[0].capacity[memory].requestPolicy.default",
            id="default-off-step",
        ),
        pytest.param(
            _device(0, _set([*POLICY, "validRange", "max"], "90Gi")),
            "spec.devices[0].capacity[memory].requestPolicy.validRange.max",
            id="max-above-value",
        ),
        pytest.param(
            _device(0, _set([*POLICY, "validRange", "min"], "81Gi")),
            "spec.devices[0].capacity[memory].requestPolicy.validRange.min",
            id="min-above-value",
        ),
        pytest.param(
            _device(0, _set(["taints"], [{"key": "gpu.fracgpu.io/unhealthy", "effect": "Never"}])),
            "spec.devices[0].taints[0].effect",
            id="taint-effect",
        ),
        pytest.param(
            _device(0, _set(["capacity", "cores", "value"], "lots")),
            "spec.devices[0].capacity[cores].value",
            id="capacity-not-a-quantity",
        ),
    ],
)
async def test_slice_validation_refuses(
    server: tuple[FakeApiServer, Any], change: Callable[[dict[str, Any]], None], field: str
) -> None:
    _, api = server
    with pytest.raises(KubeInvalid) as caught:
        await call_json(api, "POST", RESOURCE_SLICES.path(), body=_edit(change))
    fields = [c["field"] for c in caught.value.body["details"]["causes"]]
    assert field in fields


@pytest.mark.parametrize(
    ("change", "field"),
    [
        pytest.param(_set(["spec", "driver"], "other.example.com"), "spec.driver", id="driver"),
        pytest.param(_set(["spec", "nodeName"], "node-b"), "spec.nodeName", id="node"),
        pytest.param(_set(["spec", "pool", "name"], "node-b"), "spec.pool.name", id="pool"),
    ],
)
async def test_slice_identity_is_immutable(
    server: tuple[FakeApiServer, Any], change: Callable[[dict[str, Any]], None], field: str
) -> None:
    _, api = server
    stored = await call_json(api, "POST", RESOURCE_SLICES.path(), body=resource_slice())
    change(stored)
    with pytest.raises(KubeInvalid) as caught:
        await call_json(
            api, "PUT", RESOURCE_SLICES.path(name=stored["metadata"]["name"]), body=stored
        )
    assert caught.value.body["details"]["causes"][0]["field"] == field


async def test_taints_get_time_added(server: tuple[FakeApiServer, Any]) -> None:
    _, api = server
    body = resource_slice(
        devices=[gpu(0, taints=[{"key": "gpu.fracgpu.io/unhealthy", "effect": "NoSchedule"}])]
    )
    stored = await call_json(api, "POST", RESOURCE_SLICES.path(), body=body)
    assert stored["spec"]["devices"][0]["taints"][0]["timeAdded"]


@pytest.mark.parametrize(
    ("requests", "field"),
    [
        pytest.param(
            [{"name": "gpu", "exactly": {"deviceClassName": "x"}, "firstAvailable": []}],
            "spec.devices.requests[0]",
            id="exactly-and-first-available",
        ),
        pytest.param(
            [{"name": "GPU", "exactly": {"deviceClassName": "x"}}],
            "spec.devices.requests[0].name",
            id="request-name",
        ),
        pytest.param(
            [{"name": "gpu", "exactly": {}}],
            "spec.devices.requests[0].exactly.deviceClassName",
            id="no-class",
        ),
        pytest.param(
            [{"name": "gpu", "exactly": {"deviceClassName": "x", "count": 0}}],
            "spec.devices.requests[0].exactly.count",
            id="count-zero",
        ),
        pytest.param(
            [
                {
                    "name": "gpu",
                    "exactly": {"deviceClassName": "x", "capacity": {"requests": {"cores": "a"}}},
                }
            ],
            "spec.devices.requests[0].exactly.capacity.requests[cores]",
            id="capacity-not-a-quantity",
        ),
    ],
)
async def test_claim_validation_refuses(
    server: tuple[FakeApiServer, Any], requests: list[Any], field: str
) -> None:
    _, api = server
    body = share_claim("c")
    body["spec"]["devices"]["requests"] = requests
    with pytest.raises(KubeInvalid) as caught:
        await call_json(api, "POST", RESOURCE_CLAIMS.path("default"), body=body)
    fields = [c["field"] for c in caught.value.body["details"]["causes"]]
    assert field in fields


async def test_claim_spec_is_immutable(server: tuple[FakeApiServer, Any]) -> None:
    _, api = server
    stored = await call_json(
        api, "POST", RESOURCE_CLAIMS.path("default"), body=share_claim("c", cores=30)
    )
    changed = copy.deepcopy(stored)
    changed["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]["cores"] = "40"
    with pytest.raises(KubeInvalid):
        await call_json(api, "PUT", RESOURCE_CLAIMS.path("default", "c"), body=changed)


# ---- the allocator: the observed scheduling cases ----------------------------------------------


def _results(fake: FakeApiServer, name: str) -> list[dict[str, Any]]:
    claim = fake.get("resourceclaims", name, "default")
    assert claim is not None
    results: list[dict[str, Any]] = claim["status"]["allocation"]["devices"]["results"]
    return results


@pytest.fixture
async def cluster() -> AsyncIterator[FakeApiServer]:
    async with FakeApiServer() as fake:
        fake.put(device_class())
        fake.put(resource_slice())
        yield fake


def _place(fake: FakeApiServer, name: str, **share: Any) -> list[str]:
    fake.put(share_claim(name, **share))
    allocate_claim(fake.store, "default", name)
    return [r["device"] for r in _results(fake, name)]


async def test_shares_pack_first_fit(cluster: FakeApiServer) -> None:
    placed = [_place(cluster, f"a{i}", cores=30, memory="8Gi") for i in range(3)]
    assert placed == [["gpu-0"], ["gpu-0"], ["gpu-0"]]


async def test_each_share_gets_its_own_share_id(cluster: FakeApiServer) -> None:
    for i in range(2):
        _place(cluster, f"a{i}", cores=30, memory="8Gi")
    ids = {_results(cluster, f"a{i}")[0]["shareID"] for i in range(2)}
    assert len(ids) == 2


async def test_a_share_that_fits_no_single_card_stays_pending(cluster: FakeApiServer) -> None:
    _place(cluster, "b0", cores=60, memory="40Gi")
    _place(cluster, "b1", cores=60, memory="40Gi")
    cluster.put(share_claim("c", cores=50, memory="50Gi"))
    with pytest.raises(Unschedulable, match="cannot allocate all claims"):
        allocate_claim(cluster.store, "default", "c")


async def test_deleting_a_share_frees_its_card(cluster: FakeApiServer) -> None:
    _place(cluster, "b0", cores=60, memory="40Gi")
    _place(cluster, "b1", cores=60, memory="40Gi")
    cluster.remove("resourceclaims", "b0", "default")
    assert _place(cluster, "c", cores=50, memory="50Gi") == ["gpu-0"]


async def test_a_whole_card_consumes_the_defaults(cluster: FakeApiServer) -> None:
    _place(cluster, "whole")
    assert _results(cluster, "whole")[0]["consumedCapacity"] == {"cores": "100", "memory": "80Gi"}


async def test_a_whole_card_excludes_shares(cluster: FakeApiServer) -> None:
    _place(cluster, "whole")
    assert _place(cluster, "a", cores=30, memory="8Gi") == ["gpu-1"]


async def test_count_two_takes_two_cards(cluster: FakeApiServer) -> None:
    assert _place(cluster, "two", count=2) == ["gpu-0", "gpu-1"]


async def test_count_two_with_any_share_placed_stays_pending(cluster: FakeApiServer) -> None:
    _place(cluster, "a", cores=30, memory="8Gi")
    cluster.put(share_claim("two", count=2))
    with pytest.raises(Unschedulable):
        allocate_claim(cluster.store, "default", "two")


async def test_consumed_capacity_rounds_up_to_the_step(cluster: FakeApiServer) -> None:
    _place(cluster, "tiny", cores=1, memory="300Mi")
    assert _results(cluster, "tiny")[0]["consumedCapacity"] == {"cores": "1", "memory": "512Mi"}


async def test_cores_over_the_maximum_stays_pending(cluster: FakeApiServer) -> None:
    cluster.put(share_claim("big", cores=150))
    with pytest.raises(Unschedulable):
        allocate_claim(cluster.store, "default", "big")


async def test_a_tainted_card_gets_no_new_share(cluster: FakeApiServer) -> None:
    taint = {"key": "gpu.fracgpu.io/unhealthy", "value": "XID-79", "effect": "NoSchedule"}
    cluster.put(resource_slice(devices=[gpu(0, taints=[taint]), gpu(1)]))
    assert _place(cluster, "a", cores=30, memory="8Gi") == ["gpu-1"]


async def test_only_the_newest_generation_counts(cluster: FakeApiServer) -> None:
    old = resource_slice(devices=[gpu(0)])
    old["metadata"]["name"] = "old"
    cluster.put(old)
    newer = resource_slice(devices=[gpu(1)])
    newer["spec"]["pool"]["generation"] = 2
    cluster.put(newer)
    assert _place(cluster, "a", cores=30, memory="8Gi") == ["gpu-1"]


async def test_a_node_without_a_slice_gets_nothing() -> None:
    async with FakeApiServer() as fake:
        fake.put(device_class())
        fake.put(share_claim("a", cores=30, memory="8Gi"))
        with pytest.raises(Unschedulable):
            allocate_claim(fake.store, "default", "a")


async def test_an_unmodelled_selector_is_refused(cluster: FakeApiServer) -> None:
    other = device_class()
    other["spec"]["selectors"][0]["cel"]["expression"] = 'device.attributes["x"].y == 1'
    cluster.put(other)
    cluster.put(share_claim("a", cores=30))
    with pytest.raises(ValueError, match="understands only"):
        allocate_claim(cluster.store, "default", "a")
