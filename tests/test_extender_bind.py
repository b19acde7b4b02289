"""The bind verb against the fake API server: write-then-bind, the Binding's UID and record,
idempotent retries, a booking reused after a crash, and what is refused before any write."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from core.placement import PLACEMENT_ANNOTATION, ContainerPlacement, parse
from extender.binder import Binder
from extender.booking import DirectBooker
from extender.ledger import Booking, Ledger
from extender.ledgerstore import KubeLedgerStore
from extender.pods import KubePods
from extender.view import node_cards
from extender.wire import ExtenderBindingArgs
from testkit.apiserver import FakeApiServer
from testkit.extender import Gpu, node, pod
from testkit.kinds import GPUNODELEDGER

NODES = {
    "n1": node("n1", Gpu("GPU-0"), Gpu("GPU-1")),
    "n2": node("n2", Gpu("GPU-2")),
}


@dataclass
class Rig:
    fake: FakeApiServer
    binder: Binder
    ledgers: KubeLedgerStore

    def args(self, name: str, node_name: str = "n1", uid: str | None = None) -> ExtenderBindingArgs:
        return ExtenderBindingArgs(
            pod_name=name, pod_namespace="team", pod_uid=uid or f"uid-{name}", node=node_name
        )

    def pod(self, name: str) -> dict[str, Any]:
        found = self.fake.get("pods", name, "team")
        assert found is not None
        return found

    async def ledger(self, node_name: str = "n1") -> Ledger:
        stored = await self.ledgers.get(node_name)
        assert stored is not None
        return stored


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    async with FakeApiServer(namespaces=("default", "team")) as fake:
        fake.register(GPUNODELEDGER)
        for obj in NODES.values():
            fake.put(obj)
        async with fake.api_client() as api:
            ledgers = KubeLedgerStore(api)
            cards = {name: node_cards(obj) for name, obj in NODES.items()}
            binder = Binder(KubePods(api), DirectBooker(ledgers), cards.get)
            yield Rig(fake, binder, ledgers)


def record_of(obj: dict[str, Any]) -> Any:
    return parse(obj["metadata"]["annotations"][PLACEMENT_ANNOTATION], pod="p")


async def test_books_then_binds_with_uid_and_record(rig: Rig) -> None:
    rig.fake.put(pod("a", (50, 8)))
    rig.fake.requests.clear()
    result = await rig.binder.bind(rig.args("a"))
    assert result.error == ""
    writes = [(r.method, r.path.rsplit("/", 1)[-1]) for r in rig.fake.requests if r.method != "GET"]
    assert writes == [("POST", "gpunodeledgers"), ("POST", "binding")]
    bound = rig.pod("a")
    assert bound["spec"]["nodeName"] == "n1"
    record = record_of(bound)
    assert record.node == "n1"
    assert record.containers == {"c0": ContainerPlacement(("GPU-0",), 50, 8)}
    ledger = await rig.ledger()
    assert ledger.bookings["uid-a"].containers == record.containers


async def test_a_retry_after_a_lost_answer_is_a_success_without_a_second_booking(rig: Rig) -> None:
    rig.fake.put(pod("a", (50, 8)))
    assert (await rig.binder.bind(rig.args("a"))).error == ""
    version = (await rig.ledger()).version
    assert (await rig.binder.bind(rig.args("a"))).error == ""
    assert (await rig.ledger()).version == version


async def test_a_booking_left_by_a_crash_is_reused_unchanged(rig: Rig) -> None:
    rig.fake.put(pod("a", (50, 8)))
    left = Booking("team", "a", {"c0": ContainerPlacement(("GPU-1",), 50, 8)})
    await rig.ledgers.create(Ledger("n1", {"uid-a": left}))
    assert (await rig.binder.bind(rig.args("a"))).error == ""
    assert record_of(rig.pod("a")).containers == left.containers  # GPU-1, not best fit GPU-0


async def test_concurrent_binds_of_one_pod_book_it_once(rig: Rig) -> None:
    rig.fake.put(pod("a", (50, 8)))
    results = await asyncio.gather(*(rig.binder.bind(rig.args("a")) for _ in range(3)))
    assert [r.error for r in results] == ["", "", ""]
    ledger = await rig.ledger()
    assert list(ledger.bookings) == ["uid-a"]
    assert record_of(rig.pod("a")).containers == ledger.bookings["uid-a"].containers


async def test_concurrent_pods_never_overbook_a_card(rig: Rig) -> None:
    for i in range(5):
        rig.fake.put(pod(f"p{i}", (40, 8)))
    results = await asyncio.gather(*(rig.binder.bind(rig.args(f"p{i}")) for i in range(5)))
    bound = [r for r in results if not r.error]
    assert len(bound) == 4  # two 0.4 shares per card, two cards
    assert all("any more; the pod will be retried" in r.error for r in results if r.error)
    ledger = await rig.ledger()
    cards = node_cards(NODES["n1"])
    assert cards is not None and ledger.overbooked(cards.cards) == []


async def test_bound_elsewhere_is_an_error_and_the_booking_stays(rig: Rig) -> None:
    rig.fake.put(pod("a", (50, 8)))
    assert (await rig.binder.bind(rig.args("a", "n2"))).error == ""
    result = await rig.binder.bind(rig.args("a", "n1"))
    assert "is bound to node n2 already" in result.error
    assert await rig.ledgers.get("n1") is None  # refused before any write


REFUSED = [
    pytest.param(None, "uid-a", "no longer exists", id="no such pod"),
    pytest.param(pod("a", (50, 8), uid="new"), "uid-a", "created again", id="another UID"),
    pytest.param(pod("a", (150, 0)), "uid-a", "whole number of cards", id="bad demand"),
    pytest.param(pod("a", (300, 0)), "uid-a", "fewer than 3", id="no room"),
]


@pytest.mark.parametrize(("obj", "uid", "why"), REFUSED)
async def test_refused_before_any_write(
    rig: Rig, obj: dict[str, Any] | None, uid: str, why: str
) -> None:
    if obj is not None:
        rig.fake.put(obj)
    result = await rig.binder.bind(rig.args("a", uid=uid))
    assert why in result.error
    assert await rig.ledgers.get("n1") is None
    if obj is not None:
        assert not rig.pod("a")["spec"].get("nodeName")


async def test_a_binding_refused_for_a_new_incarnation_leaves_the_booking(rig: Rig) -> None:
    rig.fake.put(pod("a", (50, 8)))

    async def swap(record: Any) -> None:
        if record.method == "POST" and record.path.endswith("/binding"):
            rig.fake.put(pod("a", (50, 8), uid="new"))

    rig.fake.on_request = swap
    result = await rig.binder.bind(rig.args("a"))
    assert "Precondition failed" in result.error
    assert list((await rig.ledger()).bookings) == ["uid-a"]  # reclaim's to free (R1)
    assert not rig.pod("a")["spec"].get("nodeName")


async def test_a_pod_without_gpu_is_bound_without_a_record(rig: Rig) -> None:
    rig.fake.put(pod("a"))
    assert (await rig.binder.bind(rig.args("a"))).error == ""
    bound = rig.pod("a")
    assert bound["spec"]["nodeName"] == "n1"
    assert PLACEMENT_ANNOTATION not in (bound["metadata"].get("annotations") or {})
    assert json.dumps(await rig.ledgers.get("n1")) == "null"


CACHE_CASES = [
    # (name, what the cache holds, whether the pod is read from the API server)
    ("this incarnation, unbound: no read", "same", False),
    ("nothing cached: read", "none", True),
    ("an older incarnation: read", "other-uid", True),
    ("bound already in the cache: read, the server decides", "bound", True),
]


@pytest.mark.parametrize(
    ("held", "read"), [c[1:] for c in CACHE_CASES], ids=[c[0] for c in CACHE_CASES]
)
async def test_bind_reads_the_pod_only_when_the_cache_cannot_vouch_for_it(
    rig: Rig, held: str, read: bool
) -> None:
    rig.fake.put(pod("a", (50, 8)))
    cached = {
        "same": pod("a", (50, 8)),
        "none": None,
        "other-uid": pod("a", (50, 8), uid="uid-old"),
        "bound": pod("a", (50, 8), node_name="n1"),
    }[held]
    binder = Binder(
        rig.binder.pods, rig.binder.booker, rig.binder.cards, cached=lambda ns, name: cached
    )
    rig.fake.requests.clear()
    result = await binder.bind(rig.args("a"))
    assert result.error == ""
    reads = [r for r in rig.fake.requests if r.method == "GET" and r.path.endswith("/pods/a")]
    assert bool(reads) == read
    assert rig.pod("a")["spec"]["nodeName"] == "n1"
