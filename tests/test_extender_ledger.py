"""The GPUNodeLedger model, its compare-and-swap loop, and both stores (memory; the API server)."""

from __future__ import annotations

from typing import Any

import pytest

from core.placement import CardRoom, ContainerPlacement
from extender.ledger import Booking, Ledger, LedgerError, from_object, to_object
from extender.ledgerstore import (
    Conflict,
    KubeLedgerStore,
    MemoryLedgerStore,
    NotFound,
    TooManyConflicts,
    cas,
    newer,
)
from testkit.apiserver import FakeApiServer
from testkit.kinds import GPUNODELEDGER

SHARE = ContainerPlacement(("GPU-a",), 50, 8)
BOOKING = Booking("team", "p", {"main": SHARE})


def test_object_round_trip() -> None:
    ledger = Ledger("n1", {"u1": BOOKING}, "7", "node-uid")
    obj = to_object(ledger)
    assert obj == {
        "apiVersion": "fracgpu.io/v1",
        "kind": "GPUNodeLedger",
        "metadata": {"name": "n1", "resourceVersion": "7", "uid": "node-uid"},
        "spec": {
            "bookings": {
                "u1": {
                    "namespace": "team",
                    "name": "p",
                    "containers": {"main": {"cards": ["GPU-a"], "core": 50, "memoryBlocks": 8}},
                }
            }
        },
    }
    assert from_object(obj) == ledger


def ledger_obj(bookings: object) -> dict[str, Any]:
    return {"metadata": {"name": "n1"}, "spec": {"bookings": bookings}}


BAD = [
    pytest.param(ledger_obj([]), "spec.bookings is not an object", id="bookings a list"),
    pytest.param(ledger_obj({"u": 1}), "booking u is not an object", id="booking not object"),
    pytest.param(ledger_obj({"u": {"name": "p", "containers": {}}}), "names no pod", id="no ns"),
    pytest.param(
        ledger_obj({"u": {"namespace": "t", "name": "p", "containers": {}}}),
        "names no container",
        id="no containers",
    ),
    pytest.param(
        ledger_obj({"u": {"namespace": "t", "name": "p", "containers": {"c": {"cards": []}}}}),
        "container 'c' is not an object with cards",
        id="a bad container",
    ),
]


@pytest.mark.parametrize(("obj", "why"), BAD)
def test_unreadable_ledgers_name_the_node_and_booking(obj: dict[str, Any], why: str) -> None:
    with pytest.raises(LedgerError, match="GPUNodeLedger n1") as caught:
        from_object(obj)
    assert why in str(caught.value)


def test_an_empty_object_is_an_empty_ledger() -> None:
    assert from_object({"metadata": {"name": "n1", "resourceVersion": "3"}}) == Ledger(
        "n1", {}, "3"
    )


def test_overbooked_and_placements() -> None:
    cards = [CardRoom(0, "GPU-a", 16)]
    ledger = Ledger("n1", {"u1": BOOKING, "u2": BOOKING})
    assert ledger.overbooked(cards) == []
    assert len(ledger.placements(exclude="u1")) == 1
    over = ledger.with_booking("u3", BOOKING)
    assert [c.uuid for c in over.overbooked(cards)] == ["GPU-a"]
    assert over.without(["u3"]).bookings.keys() == {"u1", "u2"}


async def test_memory_store_follows_the_version_rules() -> None:
    store = MemoryLedgerStore()
    assert await store.get("n1") is None
    first = await store.create(Ledger("n1"))
    with pytest.raises(Conflict):
        await store.create(Ledger("n1"))
    second = await store.replace(first.with_booking("u1", BOOKING))
    with pytest.raises(Conflict):
        await store.replace(first.with_booking("u2", BOOKING))
    with pytest.raises(NotFound):
        await store.replace(Ledger("n2", version="1"))
    assert await store.get("n1") == second


async def test_cas_creates_a_missing_ledger_and_skips_a_write_that_changes_nothing() -> None:
    store = MemoryLedgerStore()
    stored = await cas(store, "n1", lambda ledger: ledger.with_booking("u1", BOOKING))
    assert stored.bookings == {"u1": BOOKING} and stored.version == "1"
    same = await cas(store, "n1", lambda ledger: ledger)
    assert same.version == "1"


class Overtaken(MemoryLedgerStore):
    """Another writer lands between every read and write, ``times`` times."""

    def __init__(self, times: int) -> None:
        super().__init__()
        self.times = times

    async def get(self, node: str) -> Ledger | None:
        current = await super().get(node)
        if self.times > 0:
            self.times -= 1
            if current is None:
                await super().create(Ledger(node))
            else:
                await super().replace(current.with_booking(f"other-{self.times}", BOOKING))
        return current


@pytest.mark.parametrize(("times", "wins"), [(1, True), (4, True), (5, False)], ids=str)
async def test_cas_recomputes_after_a_conflict_a_bounded_number_of_times(
    times: int, wins: bool
) -> None:
    store = Overtaken(times)
    calls: list[int] = []

    def change(ledger: Ledger) -> Ledger:
        calls.append(len(ledger.bookings))
        return ledger.with_booking("mine", BOOKING)

    if wins:
        stored = await cas(store, "n1", change)
        assert "mine" in stored.bookings
        assert len(stored.bookings) == times  # every other writer's booking kept
    else:
        with pytest.raises(TooManyConflicts, match="node n1"):
            await cas(store, "n1", change)
    assert len(calls) == min(times + 1, 5)


async def test_kube_store_against_the_api_server(tmp_path: Any) -> None:
    async with FakeApiServer() as fake:
        fake.register(GPUNODELEDGER)
        fake.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})
        node_uid = fake.get("nodes", "n1")["metadata"]["uid"]  # type: ignore[index]
        async with fake.api_client() as api:
            store = KubeLedgerStore(api, owner=lambda node: node_uid)
            assert await store.get("n1") is None
            created = await store.create(Ledger("n1", {"u1": BOOKING}))
            assert created.version and created.bookings == {"u1": BOOKING}
            stored = fake.get("gpunodeledgers", "n1")
            assert stored is not None
            assert stored["metadata"]["ownerReferences"][0]["uid"] == node_uid
            with pytest.raises(Conflict):
                await store.create(Ledger("n1"))
            replaced = await store.replace(created.without(["u1"]))
            assert replaced.bookings == {}
            with pytest.raises(Conflict):
                await store.replace(created)  # stale version
            assert await store.get("n1") == replaced
            assert store.newest["n1"] == replaced  # what filter sees before the watch does


NEWER = [
    pytest.param(None, Ledger("n", version="2"), "2", id="only one read"),
    pytest.param(Ledger("n", version="3"), Ledger("n", version="2"), "3", id="the first is newer"),
    pytest.param(Ledger("n", version="9"), Ledger("n", version="10"), "10", id="numerically"),
    pytest.param(Ledger("n", version="4"), None, "4", id="only the first"),
]


@pytest.mark.parametrize(("a", "b", "version"), NEWER)
def test_newer(a: Ledger | None, b: Ledger | None, version: str) -> None:
    assert newer(a, b).version == version


class Recalling(MemoryLedgerStore):
    """A store that recalls a given ledger (this replica's newest read or write) and counts
    its reads."""

    def __init__(self) -> None:
        super().__init__()
        self.recall: Ledger | None = None
        self.reads = 0

    def recalled(self, node: str) -> Ledger | None:
        return self.recall

    async def get(self, node: str) -> Ledger | None:
        self.reads += 1
        return await super().get(node)


async def _recalling(stale: bool) -> Recalling:
    store = Recalling()
    first = await cas(store, "n1", lambda ledger: ledger.with_booking("u1", BOOKING))
    store.recall = first
    if stale:  # another replica writes after this one last saw the ledger
        await store.replace(first.with_booking("other", BOOKING))
    store.reads = 0
    return store


RECALL_CASES = [
    # (name, recall stale, change, reads, bookings after)
    ("a fresh recall writes without a read", False, "add", 0, {"u1", "u2"}),
    ("a stale recall conflicts, then reads and writes", True, "add", 1, {"u1", "other", "u2"}),
    ("writing nothing is confirmed on a fresh read", False, "keep", 1, {"u1"}),
    ("giving up is confirmed on a fresh read", True, "give-up-unless-other", 1,
     {"u1", "other", "u2"}),
]  # fmt: skip


@pytest.mark.parametrize(
    ("stale", "how", "reads", "after"),
    [c[1:] for c in RECALL_CASES],
    ids=[c[0] for c in RECALL_CASES],
)
async def test_cas_takes_only_a_write_from_a_recalled_ledger(
    stale: bool, how: str, reads: int, after: set[str]
) -> None:
    store = await _recalling(stale)

    def change(ledger: Ledger) -> Ledger:
        if how == "keep":
            return ledger
        if how == "give-up-unless-other" and "other" not in ledger.bookings:
            raise RuntimeError("no room, as this replica last saw it")
        return ledger.with_booking("u2", BOOKING)

    stored = await cas(store, "n1", change)
    assert store.reads == reads
    assert set(stored.bookings) == after
    assert set((await MemoryLedgerStore.get(store, "n1") or Ledger("n1")).bookings) == after
