"""The node's ResourceSlice: its devices, and the publisher that keeps exactly one of it,
against the fake API server (which re-serialises quantities and stamps taints as 1.36 does)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from core.kube import KubeNotFound
from deviceplugin.dra.slices import (
    PCI_BUS_ID,
    CardState,
    SlicePublisher,
    device,
    memory_capacity,
    same_devices,
)
from deviceplugin.shared.inventory import Card, CardDetails
from testkit.apiserver import FakeApiServer

DRIVER = "gpu.fracgpu.io"
NODE = "node-a"


def card(index: int, memory_mib: int = 81559, numa: int | None = None) -> Card:
    return Card(index, f"GPU-{index}", "NVIDIA H100 80GB HBM3", memory_mib, index, numa)


NO_DETAILS = CardDetails(None, None)


@pytest.mark.parametrize(
    ("memory_mib", "capacity"),
    [
        pytest.param(81559, 81408 * 2**20, id="h100-rounds-down"),
        pytest.param(24576, 24576 * 2**20, id="already-a-step"),
        pytest.param(255, 0, id="under-one-step"),
    ],
)
def test_memory_is_rounded_down_to_the_step(memory_mib: int, capacity: int) -> None:
    assert memory_capacity(card(0, memory_mib)) == capacity


@pytest.mark.parametrize(
    ("state", "version", "expected"),
    [
        pytest.param(
            CardState(card(0), NO_DETAILS),
            None,
            {"uuid", "index", "productName"},
            id="nvml-says-little",
        ),
        pytest.param(
            CardState(card(0, numa=1), CardDetails("0000:3b:00.0", "9.0")),
            "550.54.15",
            {
                "uuid",
                "index",
                "productName",
                PCI_BUS_ID,
                "numaNode",
                "computeCapability",
                "driverVersion",
            },
            id="nvml-says-all",
        ),
    ],
)
def test_attributes_as_available(state: CardState, version: str | None, expected: set[str]) -> None:
    assert set(device(state, DRIVER, version)["attributes"]) == expected


def test_a_healthy_card_has_no_taint() -> None:
    assert "taints" not in device(CardState(card(0), NO_DETAILS), DRIVER, None)


def test_an_unhealthy_card_is_tainted_no_schedule() -> None:
    entry = device(CardState(card(0), NO_DETAILS, False, "XID 79"), DRIVER, None)
    assert entry["taints"] == [
        {"key": f"{DRIVER}/unhealthy", "value": "XID-79", "effect": "NoSchedule"}
    ]


def test_capacities_default_to_the_whole_card() -> None:
    capacity = device(CardState(card(0), NO_DETAILS), DRIVER, None)["capacity"]
    defaults = {name: c["requestPolicy"]["default"] for name, c in capacity.items()}
    assert defaults == {"cores": "100", "memory": "81408Mi"}


@pytest.mark.parametrize(
    ("stored", "same"),
    [
        pytest.param("80Gi", True, id="re-serialised-binary"),
        pytest.param("85899345920", True, id="plain-bytes"),
        pytest.param("81Gi", False, id="really-different"),
    ],
)
def test_devices_compare_by_value(stored: str, same: bool) -> None:
    wanted = device(CardState(card(0, 81920), NO_DETAILS), DRIVER, None)
    seen = device(CardState(card(0, 81920), NO_DETAILS), DRIVER, None)
    seen["capacity"]["memory"]["value"] = stored
    assert same_devices([seen], [wanted]) is same


def test_taint_times_do_not_make_devices_differ() -> None:
    wanted = device(CardState(card(0), NO_DETAILS, False, "XID 79"), DRIVER, None)
    seen = device(CardState(card(0), NO_DETAILS, False, "XID 79"), DRIVER, None)
    seen["taints"][0]["timeAdded"] = "2026-11-24T00:00:00Z"
    assert same_devices([seen], [wanted])


# ---- the publisher against the fake API server -------------------------------------------------


@dataclass
class Board:
    states: list[CardState]

    def get(self) -> list[CardState]:
        return list(self.states)


@pytest.fixture
async def env() -> AsyncIterator[tuple[FakeApiServer, SlicePublisher, Board]]:
    async with FakeApiServer() as fake, fake.api_client() as api:
        fake.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        # 80 GiB exactly: the server stores "80Gi" where the publisher wrote "81920Mi".
        board = Board([CardState(card(i, 81920), NO_DETAILS) for i in range(2)])
        publisher = SlicePublisher(
            api, node=NODE, driver=DRIVER, states=board.get, driver_version=None
        )
        await publisher.start()
        try:
            yield fake, publisher, board
        finally:
            await publisher.stop()


def slices(fake: FakeApiServer) -> list[dict[str, Any]]:
    return fake.objects("resourceslices")


async def until(predicate: Any, within_s: float = 3.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return bool(predicate())


def settled(fake: FakeApiServer, publisher: SlicePublisher) -> bool:
    """The publisher's watch has shown it every slice as the server holds it now: until then a
    pass waits for the event instead of writing, and the write it owes comes later."""
    stored = slices(fake)
    return bool(stored) and all(
        (publisher.informer.get(o["metadata"]["name"]) or {})
        .get("metadata", {})
        .get("resourceVersion")
        == o["metadata"]["resourceVersion"]
        for o in stored
    )


async def test_one_slice_owned_by_the_node(
    env: tuple[FakeApiServer, SlicePublisher, Board],
) -> None:
    fake, _, _ = env
    assert await until(lambda: len(slices(fake)) == 1)
    node = fake.get("nodes", NODE)
    assert node is not None
    owner = slices(fake)[0]["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "Node",
        NODE,
        node["metadata"]["uid"],
        True,
    )


async def test_the_pool_is_the_node_at_generation_one(
    env: tuple[FakeApiServer, SlicePublisher, Board],
) -> None:
    fake, _, _ = env
    assert await until(lambda: len(slices(fake)) == 1)
    assert slices(fake)[0]["spec"]["pool"] == {
        "name": NODE,
        "generation": 1,
        "resourceSliceCount": 1,
    }


async def test_passes_after_publishing_write_nothing(
    env: tuple[FakeApiServer, SlicePublisher, Board],
) -> None:
    fake, publisher, _ = env
    assert await until(lambda: len(slices(fake)) == 1)
    await asyncio.wait_for(publisher.in_sync.wait(), 3)
    version = fake.resource_version
    for _ in range(5):
        await publisher.sync_once()
    assert fake.resource_version == version


async def test_a_tainted_slice_is_not_rewritten_forever(
    env: tuple[FakeApiServer, SlicePublisher, Board],
) -> None:
    fake, publisher, board = env
    assert await until(lambda: len(slices(fake)) == 1)
    board.states[1] = CardState(card(1, 81920), NO_DETAILS, False, "XID 79")
    publisher.poke()
    assert await until(lambda: "taints" in slices(fake)[0]["spec"]["devices"][1])
    assert await until(lambda: settled(fake, publisher))
    version = fake.resource_version
    for _ in range(5):
        await asyncio.sleep(0.01)
        await publisher.sync_once()
    assert fake.resource_version == version


async def test_a_health_change_bumps_the_generation(
    env: tuple[FakeApiServer, SlicePublisher, Board],
) -> None:
    fake, publisher, board = env
    assert await until(lambda: len(slices(fake)) == 1)
    board.states[1] = CardState(card(1, 81920), NO_DETAILS, False, "XID 79")
    publisher.poke()
    assert await until(lambda: slices(fake)[0]["spec"]["pool"]["generation"] == 2)


async def test_a_wiped_slice_is_published_again(
    env: tuple[FakeApiServer, SlicePublisher, Board],
) -> None:
    fake, _, _ = env
    assert await until(lambda: len(slices(fake)) == 1)
    first = slices(fake)[0]["metadata"]["name"]
    fake.remove("resourceslices", first)
    assert await until(lambda: len(slices(fake)) == 1, within_s=2.0)


async def test_surplus_slices_are_deleted(env: tuple[FakeApiServer, SlicePublisher, Board]) -> None:
    fake, _, _ = env
    assert await until(lambda: len(slices(fake)) == 1)
    extra = dict(slices(fake)[0])
    extra["metadata"] = {"name": "stale-copy"}
    extra["spec"] = {**extra["spec"], "pool": {"name": NODE, "generation": 0,
                                                "resourceSliceCount": 1}}  # fmt: skip
    fake.put(extra)
    assert await until(lambda: [s["metadata"]["name"] for s in slices(fake)] != ["stale-copy"])
    assert await until(lambda: len(slices(fake)) == 1)


async def test_a_conflict_is_retried(env: tuple[FakeApiServer, SlicePublisher, Board]) -> None:
    fake, publisher, board = env
    assert await until(lambda: len(slices(fake)) == 1)
    fake.fail_writes("resourceslices", slices(fake)[0]["metadata"]["name"], times=2)
    board.states[0] = CardState(card(0, 81920), NO_DETAILS, False, "lost")
    publisher.poke()
    assert await until(lambda: "taints" in slices(fake)[0]["spec"]["devices"][0])


async def test_an_api_server_outage_is_retried(
    env: tuple[FakeApiServer, SlicePublisher, Board],
) -> None:
    fake, publisher, board = env
    assert await until(lambda: len(slices(fake)) == 1)
    fake.down("503", seconds=0.3)
    board.states[0] = CardState(card(0, 81920), NO_DETAILS, False, "lost")
    publisher.poke()
    assert await until(lambda: "taints" in slices(fake)[0]["spec"]["devices"][0], within_s=5.0)


async def test_a_wrong_node_name_says_how_to_fix() -> None:
    async with FakeApiServer() as fake, fake.api_client() as api:
        publisher = SlicePublisher(
            api, node="no-such-node", driver=DRIVER, states=lambda: [], driver_version=None
        )
        with pytest.raises(KubeNotFound, match=r"--node-name .* must name this node"):
            await publisher.sync_once()


async def test_a_write_the_watch_has_not_shown_yet_is_not_repeated() -> None:
    async with FakeApiServer() as fake, fake.api_client() as api:
        fake.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        board = Board([CardState(card(0), NO_DETAILS)])
        # Not started: its cache never sees the slice it creates, as a slow watch would not.
        publisher = SlicePublisher(
            api, node=NODE, driver=DRIVER, states=board.get, driver_version=None
        )
        await publisher.sync_once()
        await publisher.sync_once()
        assert len(slices(fake)) == 1
