"""Each prepared share shown in its claim's status.devices, against the fake API server: what
an entry says, that other drivers' entries stay, that nothing is written when nothing changed,
health, removal, concurrent writers, and a cluster that drops the field."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from core.kube import RESOURCE_CLAIMS, call_json, kube_client
from deviceplugin.dra.claims import ClaimRef, Result
from deviceplugin.dra.status import HEALTHY, READY, ClaimStatusWriter
from deviceplugin.shared.inventory import Card
from testkit.apiserver import DEFAULT_NAMESPACES, FakeApiServer

DRIVER = "gpu.fracgpu.io"
GIB = 2**30
CARD = Card(index=2, uuid="GPU-2", product="NVIDIA H100 80GB HBM3", memory_mib=81559, minor=2,
            numa_node=None)  # fmt: skip
REF = ClaimRef("team", "pod-gpu", "")
SHARE = Result("gpu", "node-a", "gpu-2", "share-1", CARD, 30, 8 * GIB)
OTHER = {"driver": "nic.example.com", "pool": "node-a", "device": "nic-0",
         "conditions": [{"type": "Ready", "status": "True", "reason": "Up", "message": "",
                         "lastTransitionTime": "2026-01-01T00:00:00Z"}]}  # fmt: skip
Obj = dict[str, Any]


def _claim() -> Obj:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": REF.name, "namespace": REF.namespace},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": DRIVER}}]}},
    }  # fmt: skip


class World:
    def __init__(self, fake: FakeApiServer, api: Any) -> None:
        self.fake, self.api = fake, api
        self.health: dict[int, tuple[bool, str]] = {}
        self.patches = 0
        self.before_patch: list[Any] = []
        self.drop_devices = False
        self.ref = REF
        self.writer = ClaimStatusWriter(
            call=self.call,
            claims_path=lambda ref: RESOURCE_CLAIMS.path(ref.namespace, ref.name),
            driver=DRIVER,
            node="node-a",
            health_of=lambda i: self.health.get(i, (True, "")),
        )

    async def call(self, method: str, path: str, body: Obj | None) -> Obj:
        if method == "PATCH":
            self.patches += 1
            for hook in self.before_patch:
                await hook()
            self.before_patch.clear()
        kind = "application/merge-patch+json" if method == "PATCH" else "application/json"
        answer = await call_json(self.api, method, path, body=body, content_type=kind)
        if self.drop_devices:
            answer.get("status", {}).pop("devices", None)
        return answer

    def devices(self) -> list[Obj]:
        claim = self.fake.get("resourceclaims", REF.name, REF.namespace)
        assert claim is not None
        return list((claim.get("status") or {}).get("devices") or [])

    def ours(self) -> list[Obj]:
        return [d for d in self.devices() if d["driver"] == DRIVER]


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async with (
        FakeApiServer(namespaces=(*DEFAULT_NAMESPACES, "team")) as fake,
        kube_client(fake.kubeconfig(tmp_path / "kubeconfig")) as api,
    ):
        created = await call_json(api, "POST", RESOURCE_CLAIMS.path("team"), body=_claim())
        status = {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-2",
             "shareID": "share-1", "consumedCapacity": {"cores": "30", "memory": "8Gi"}},
            {"request": "nic", "driver": "nic.example.com", "pool": "node-a", "device": "nic-0"},
        ]}}, "devices": [OTHER]}  # fmt: skip
        path = RESOURCE_CLAIMS.path("team", REF.name) + "/status"
        await call_json(api, "PUT", path, body={**created, "status": status})
        w = World(fake, api)
        w.ref = ClaimRef("team", REF.name, created["metadata"]["uid"])
        yield w


def _condition(entry: Obj, kind: str) -> Obj:
    (found,) = [c for c in entry["conditions"] if c["type"] == kind]
    return found


async def test_a_prepared_share_is_shown_with_its_card_and_amounts(world: World) -> None:
    await world.writer.sync(world.ref, (SHARE,))
    (entry,) = world.ours()
    assert (entry["pool"], entry["device"], entry["shareID"]) == ("node-a", "gpu-2", "share-1")
    assert entry["data"] == {"card": 2, "uuid": "GPU-2", "model": "NVIDIA H100 80GB HBM3",
                             "cores": 30, "memoryMiB": 8192}  # fmt: skip
    assert _condition(entry, READY)["status"] == "True"
    assert _condition(entry, HEALTHY)["status"] == "True"
    assert world.writer.supported is True


async def test_other_drivers_entries_are_kept(world: World) -> None:
    await world.writer.sync(world.ref, (SHARE,))
    await world.writer.sync(world.ref, ())
    assert world.devices() == [OTHER]


async def test_nothing_is_written_when_nothing_changed(world: World) -> None:
    await world.writer.sync(world.ref, (SHARE,))
    await world.writer.sync(world.ref, (SHARE,))
    assert world.patches == 1


async def test_an_unhealthy_card_shows_in_the_claim_and_ready_keeps_its_time(world: World) -> None:
    await world.writer.sync(world.ref, (SHARE,))
    ready_since = _condition(world.ours()[0], READY)["lastTransitionTime"]
    world.health[2] = (False, "XID 79: the card fell off the bus")
    await world.writer.sync(world.ref, (SHARE,))
    (entry,) = world.ours()
    healthy = _condition(entry, HEALTHY)
    assert (healthy["status"], healthy["reason"]) == ("False", "Unhealthy")
    assert healthy["message"] == "XID 79: the card fell off the bus"
    assert _condition(entry, READY)["lastTransitionTime"] == ready_since


async def test_a_concurrent_write_is_not_lost(world: World) -> None:
    async def another_writer() -> None:
        path = RESOURCE_CLAIMS.path("team", REF.name) + "/status"
        extra = {**OTHER, "device": "nic-1"}
        body = {"status": {"devices": [OTHER, extra]}}
        await call_json(world.api, "PATCH", path, body=body,
                        content_type="application/merge-patch+json")  # fmt: skip

    world.before_patch.append(another_writer)
    await world.writer.sync(world.ref, (SHARE,))
    assert {d["device"] for d in world.devices()} == {"nic-0", "nic-1", "gpu-2"}


async def test_a_deleted_or_replaced_claim_is_left_alone(world: World) -> None:
    await world.writer.sync(ClaimRef("team", REF.name, "another-uid"), (SHARE,))
    await world.writer.sync(ClaimRef("team", "gone", "uid"), (SHARE,))
    assert world.patches == 0


async def test_a_cluster_that_drops_the_field_is_written_once(world: World) -> None:
    world.drop_devices = True
    await world.writer.sync(world.ref, (SHARE,))
    assert world.writer.supported is False
    await world.writer.sync(world.ref, ())
    world.writer.mark(world.ref, (SHARE,))
    assert world.patches == 1
    assert world.writer.idle()
