"""Reading what a ResourceClaim grants on this node, and the limits file it becomes."""

from __future__ import annotations

from typing import Any

import pytest

from core.contract import Limits
from core.policy import HARD_CAP, OPAQUE_API_VERSION, OPAQUE_KIND, Priority, SharePolicy
from deviceplugin.dra.claims import ClaimError, ClaimRef, limits, policy, results
from deviceplugin.shared.inventory import Card

DRIVER = "gpu.fracgpu.io"
GIB = 2**30
CARDS = {
    i: Card(index=i, uuid=f"GPU-{i}", product="H100", memory_mib=81559, minor=i, numa_node=None)
    for i in range(2)
}
REF = ClaimRef("team", "pod-gpu-x1", "uid-1")


def result(device: str = "gpu-0", **extra: Any) -> dict[str, Any]:
    entry = {
        "request": "gpu",
        "driver": DRIVER,
        "pool": "node-a",
        "device": device,
        "shareID": f"share-{device}",
        "consumedCapacity": {"cores": "30", "memory": "8Gi"},
    }
    entry.update(extra)
    return entry


def claim(*entries: dict[str, Any], uid: str = "uid-1") -> dict[str, Any]:
    return {
        "metadata": {"name": REF.name, "namespace": REF.namespace, "uid": uid},
        "status": {"allocation": {"devices": {"results": list(entries)}}},
    }


def read(obj: dict[str, Any]) -> list[Any]:
    return results(REF, obj, driver=DRIVER, pool="node-a", cards=CARDS)


def test_a_share_reads_its_card_and_amounts() -> None:
    (granted,) = read(claim(result()))
    assert (granted.card.uuid, granted.cores, granted.memory_bytes) == ("GPU-0", 30, 8 * GIB)


def test_the_share_id_is_kept() -> None:
    (granted,) = read(claim(result()))
    assert granted.share_id == "share-gpu-0"


def test_other_drivers_results_are_skipped() -> None:
    granted = read(claim(result(driver="net.example.com", device="eth0"), result()))
    assert [g.device for g in granted] == ["gpu-0"]


def test_subrequest_names_become_the_base_request() -> None:
    (granted,) = read(claim(result(request="gpu/h100")))
    assert granted.request == "gpu"


def test_without_consumed_capacity_the_whole_card_is_granted() -> None:
    (granted,) = read(claim(result(consumedCapacity=None)))
    assert (granted.cores, granted.memory_bytes) == (100, 81559 * 2**20)


@pytest.mark.parametrize(
    ("obj", "words"),
    [
        pytest.param(claim(result(), uid="uid-2"), "was replaced", id="uid-changed"),
        pytest.param(
            {"metadata": {"uid": "uid-1"}, "status": {}}, "not allocated yet", id="unallocated"
        ),
        pytest.param(claim(result(pool="node-b")), "pool 'node-b'", id="other-node"),
        pytest.param(claim(result(device="gpu-7")), "'gpu-7' is not a card", id="unknown-card"),
        pytest.param(claim(result(device="eth0")), "'eth0' is not a card", id="not-a-card-name"),
        pytest.param(
            claim(result(consumedCapacity={"cores": "0.5", "memory": "8Gi"})),
            "positive whole number",
            id="fractional-cores",
        ),
        pytest.param(
            claim(result(consumedCapacity={"cores": "150", "memory": "8Gi"})),
            "a card has 100",
            id="cores-over-a-card",
        ),
        pytest.param(
            claim(result(consumedCapacity={"cores": "30", "memory": "lots"})),
            "not a quantity",
            id="memory-not-a-quantity",
        ),
        pytest.param(
            claim(result(driver="net.example.com")), "no device of driver", id="none-of-ours"
        ),
    ],
)
def test_claims_that_cannot_be_prepared(obj: dict[str, Any], words: str) -> None:
    with pytest.raises(ClaimError, match=words):
        read(obj)


def test_the_error_names_the_claim() -> None:
    with pytest.raises(ClaimError, match=r"ResourceClaim team/pod-gpu-x1 \(uid uid-1\)"):
        read(claim(result(device="gpu-7")))


def test_limits_of_a_share() -> None:
    assert limits(REF, read(claim(result()))) == Limits(("GPU-0",), 8 * GIB, 30)


def test_limits_of_two_cards() -> None:
    granted = read(claim(result(), result(device="gpu-1")))
    assert limits(REF, granted) == Limits(("GPU-0", "GPU-1"), 8 * GIB, 30)


@pytest.mark.parametrize(
    "entries",
    [
        pytest.param(
            [result(), result(device="gpu-1", consumedCapacity={"cores": "50", "memory": "8Gi"})],
            id="different-cores",
        ),
        pytest.param(
            [result(), result(device="gpu-1", consumedCapacity={"cores": "30", "memory": "9Gi"})],
            id="different-memory",
        ),
    ],
)
def test_limits_refuse_unequal_shares(entries: list[dict[str, Any]]) -> None:
    with pytest.raises(ClaimError, match="same cores and memory on every card"):
        limits(REF, read(claim(*entries)))


def test_limits_refuse_the_same_card_twice() -> None:
    twice = [result(), result(request="other", shareID="share-2")]
    with pytest.raises(ClaimError, match="more than once"):
        limits(REF, read(claim(*twice)))


def _configured(*parameters: object, driver: str = DRIVER) -> dict[str, Any]:
    obj = claim(result())
    obj["spec"] = {
        "devices": {
            "config": [
                {"requests": ["gpu"], "opaque": {"driver": driver, "parameters": p}}
                for p in parameters
            ]
        }
    }
    return obj


OPAQUE = {"apiVersion": OPAQUE_API_VERSION, "kind": OPAQUE_KIND}


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        pytest.param(claim(result()), HARD_CAP, id="no-configuration-a-hard-cap"),
        pytest.param(
            _configured({**OPAQUE, "ceiling": 100, "priority": "high"}),
            SharePolicy(100, Priority.HIGH),
            id="admissions-policy",
        ),
        pytest.param(
            _configured({"anything": 1}, driver="gpu.nvidia.com"),
            HARD_CAP,
            id="another-drivers-configuration-is-not-ours",
        ),
    ],
)
def test_the_claims_compute_policy(obj: dict[str, Any], expected: SharePolicy) -> None:
    assert policy(REF, obj, driver=DRIVER) == expected


@pytest.mark.parametrize(
    ("obj", "words"),
    [
        pytest.param(
            _configured({**OPAQUE, "ceiling": 100}, {**OPAQUE, "ceiling": 50}),
            "has 2 configurations for driver gpu.fracgpu.io",
            id="two-configurations",
        ),
        pytest.param(
            _configured({"apiVersion": "v9", "kind": "Other"}),
            "is not a compute policy: not a gpu.fracgpu.io/v1 SharePolicy",
            id="another-kind",
        ),
        pytest.param(
            _configured({**OPAQUE, "ceiling": 300}),
            "ceiling must be 0 (a hard cap) to 100, got 300",
            id="ceiling-over-a-card",
        ),
        pytest.param(
            _configured({**OPAQUE, "priority": "urgent"}),
            "priority must be high or low, got 'urgent'",
            id="unknown-priority",
        ),
    ],
)
def test_a_configuration_that_is_no_policy_is_refused(obj: dict[str, Any], words: str) -> None:
    with pytest.raises(ClaimError) as caught:
        policy(REF, obj, driver=DRIVER)
    assert str(caught.value).startswith(str(REF))
    assert words in str(caught.value)
