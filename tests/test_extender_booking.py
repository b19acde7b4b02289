"""extender.booking: a batch books what one-by-one booking would, in one write; the group
booker answers every waiter, over conflicts, cancellations and a second replica."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest

from extender.booking import DirectBooker, GroupBooker, NoRoom, book_all
from extender.demand import PodDemand, pod_demand
from extender.ledger import Booking, Ledger
from extender.ledgerstore import Conflict, MemoryLedgerStore, TooManyConflicts
from extender.view import NodeCards, node_cards
from testkit.extender import Gpu, node, pod

TWO = node_cards(node("n1", Gpu("GPU-0"), Gpu("GPU-1")))
assert TWO is not None


def demand(name: str, *shares: tuple[int, int], uid: str | None = None) -> PodDemand:
    return pod_demand(pod(name, *shares, uid=uid))


def one_by_one(
    ledger: Ledger, cards: NodeCards, demands: list[PodDemand]
) -> tuple[Ledger, list[Booking | NoRoom]]:
    """What the same demands give when each is booked by a write of its own, in order."""
    outcomes: list[Booking | NoRoom] = []
    for each in demands:
        ledger, (outcome,) = book_all(ledger, cards, [each])
        outcomes.append(outcome)
    return ledger, outcomes


def kinds(outcomes: list[Booking | NoRoom]) -> list[str]:
    return ["booked" if isinstance(o, Booking) else "no room" for o in outcomes]


CASES = [
    ("all fit", [("a", (50, 8)), ("b", (50, 8)), ("c", (100, 0))], ["booked"] * 3),
    ("the third finds no card", [("a", (100, 0)), ("b", (100, 0)), ("c", (10, 1))],
     ["booked", "booked", "no room"]),
    ("memory runs out first", [("a", (10, 90)), ("b", (10, 90)), ("c", (10, 20))],
     ["booked", "booked", "no room"]),
    ("a later small one still fits", [("a", (100, 0)), ("b", (80, 0)), ("c", (30, 0)),
                                      ("d", (20, 0))], ["booked", "booked", "no room", "booked"]),
]  # fmt: skip


@pytest.mark.parametrize(("demands", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_batch_books_what_one_write_each_would(
    demands: list[tuple[str, tuple[int, int]]], expected: list[str]
) -> None:
    assert TWO is not None
    asked = [demand(name, share) for name, share in demands]
    batch_ledger, batch = book_all(Ledger("n1"), TWO, asked)
    single_ledger, single = one_by_one(Ledger("n1"), TWO, asked)
    assert kinds(batch) == expected
    assert batch_ledger.bookings == single_ledger.bookings
    assert [o for o in batch if isinstance(o, Booking)] == [
        o for o in single if isinstance(o, Booking)
    ]


def test_random_batches_equal_one_write_each_and_never_overbook() -> None:
    assert TWO is not None
    shuffle = random.Random(38)
    for _ in range(300):
        asked = [
            demand(f"p{i}", (shuffle.choice([10, 25, 50, 70, 100]), shuffle.randint(0, 96)))
            for i in range(shuffle.randint(1, 7))
        ]
        batch_ledger, batch = book_all(Ledger("n1"), TWO, asked)
        single_ledger, single = one_by_one(Ledger("n1"), TWO, asked)
        assert batch_ledger.bookings == single_ledger.bookings
        assert kinds(batch) == kinds(single)
        assert not batch_ledger.overbooked(TWO.cards)


def test_a_booking_already_made_is_kept_and_nothing_is_written() -> None:
    assert TWO is not None
    first, (made,) = book_all(Ledger("n1"), TWO, [demand("a", (50, 8))])
    again, (kept,) = book_all(first, TWO, [demand("a", (50, 8))])
    assert kept == made
    assert again is first


async def test_a_burst_on_one_node_is_booked_in_few_writes() -> None:
    store = MemoryLedgerStore()
    booker = GroupBooker(store)
    assert TWO is not None
    asked = [demand(f"p{i}", (10, 1)) for i in range(20)]
    results = await asyncio.gather(*(booker.book("n1", TWO, d) for d in asked))
    assert all(isinstance(r, Booking) for r in results)
    stored = await store.get("n1")
    assert stored is not None and len(stored.bookings) == 20
    # The first demand writes alone; every other one arrived while it was in flight.
    assert store.written <= 2
    assert not booker._writers and not booker._queues


async def test_demands_beyond_the_cards_get_no_room_and_the_rest_their_booking() -> None:
    booker = GroupBooker(MemoryLedgerStore())
    assert TWO is not None
    asked = [demand(f"w{i}", (100, 0)) for i in range(3)]
    results = await asyncio.gather(
        *(booker.book("n1", TWO, d) for d in asked), return_exceptions=True
    )
    assert [type(r).__name__ for r in results] == ["Booking", "Booking", "NoRoom"]
    assert "card" in str(results[2])


async def test_a_waiter_that_gives_up_leaves_the_others_answered() -> None:
    booker = GroupBooker(MemoryLedgerStore())
    assert TWO is not None
    first = asyncio.create_task(booker.book("n1", TWO, demand("a", (50, 8))))
    gone = asyncio.create_task(booker.book("n1", TWO, demand("b", (50, 8))))
    last = asyncio.create_task(booker.book("n1", TWO, demand("c", (50, 8))))
    await asyncio.sleep(0)
    gone.cancel()
    assert isinstance(await first, Booking)
    assert isinstance(await last, Booking)
    with pytest.raises(asyncio.CancelledError):
        await gone


class Overtaken(MemoryLedgerStore):
    """A store some other writer always overtakes."""

    async def replace(self, ledger: Ledger) -> Ledger:
        raise Conflict("overtaken")

    async def create(self, ledger: Ledger) -> Ledger:
        raise Conflict("overtaken")


async def test_a_write_overtaken_every_time_fails_every_waiter_of_its_batch() -> None:
    booker = GroupBooker(Overtaken())
    assert TWO is not None
    results = await asyncio.gather(
        *(booker.book("n1", TWO, demand(f"p{i}", (10, 1))) for i in range(3)),
        return_exceptions=True,
    )
    assert all(isinstance(r, TooManyConflicts) for r in results)
    assert not booker._writers


class Slow(MemoryLedgerStore):
    """A store whose reads and writes yield to other tasks, as a real one does."""

    async def get(self, node: str) -> Ledger | None:
        await asyncio.sleep(0)
        found = await super().get(node)
        return None if found is None else replace(found)

    async def replace(self, ledger: Ledger) -> Ledger:
        await asyncio.sleep(0)
        return await super().replace(ledger)

    async def create(self, ledger: Ledger) -> Ledger:
        await asyncio.sleep(0)
        return await super().create(ledger)


async def test_two_replicas_booking_one_node_never_overbook_it() -> None:
    """Two replicas' group bookers (and a direct one) against one store: their writes conflict
    and retry; what fits is booked once, the rest told there is no room, no card overbooked."""
    store = Slow()
    replicas = [GroupBooker(store, attempts=50), GroupBooker(store, attempts=50)]
    direct = DirectBooker(store, attempts=50)
    assert TWO is not None
    calls = []
    for i in range(24):
        booker = direct if i % 8 == 7 else replicas[i % 2]
        calls.append(booker.book("n1", TWO, demand(f"p{i}", (25, 4))))
    results = await asyncio.gather(*calls, return_exceptions=True)
    made = [r for r in results if isinstance(r, Booking)]
    assert len(made) == 8  # two cards of four quarters each
    assert all(isinstance(r, NoRoom) for r in results if not isinstance(r, Booking))
    stored = await store.get("n1")
    assert stored is not None and len(stored.bookings) == 8
    assert not stored.overbooked(TWO.cards)
