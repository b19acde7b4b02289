"""The ledger (ledger.Ledger) and the records it holds (allocation.Allocation), as tables."""

from __future__ import annotations

import pytest

from deviceplugin.classic.allocation import Allocation, container_dir_name
from deviceplugin.classic.ids import Kind, core_id, memory_id
from deviceplugin.classic.ledger import Ledger
from deviceplugin.classic.shown import ShownIds
from deviceplugin.shared.inventory import Card

CARDS = {i: Card(i, f"GPU-{i}", "Fake", 1024, i, None) for i in range(2)}
BLOCKS = {i: 4 for i in CARDS}  # 1024 MiB: four blocks


def ledger() -> Ledger:
    return Ledger(CARDS, BLOCKS, ShownIds(BLOCKS))


def share(
    core: int,
    memory: int,
    *,
    card: int = 0,
    key: str = "a",
    created: float = 0.0,
    cards: tuple[int, ...] = (),
) -> Allocation:
    """A container of ``core`` hundredths and ``memory`` blocks; its IDs on ``card`` (they name
    no card: any will do)."""
    return Allocation(
        core=tuple(core_id(card, i) for i in range(core)),
        memory=tuple(memory_id(card, i) for i in range(memory)),
        cards=cards,
        created=created,
        key=key,
    )


RECORDS = [  # (core, memory, whole cards, whole cards only, placeable)
    pytest.param(30, 2, 0, False, True, id="a share"),
    pytest.param(30, 0, 0, False, False, id="a share's first half"),
    pytest.param(0, 2, 0, False, False, id="memory first"),
    pytest.param(100, 0, 1, True, True, id="a whole card"),
    pytest.param(100, 4, 1, False, True, id="a whole card with its memory"),
]


@pytest.mark.parametrize(("core", "memory", "whole", "only", "placeable"), RECORDS)
def test_allocation(core: int, memory: int, whole: int, only: bool, placeable: bool) -> None:
    record = share(core, memory)
    assert (record.whole_cards, record.whole_cards_only, record.placeable) == (
        whole,
        only,
        placeable,
    )
    assert record.dir_name == (container_dir_name(record.core) if core else None)
    assert Allocation.from_json(record.to_json()) == record


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(
            {"core": "g0-c0", "memory": [], "cards": [], "created": 0, "key": "k"},
            id="core not a list",
        ),
        pytest.param(
            {"core": [0], "memory": [], "cards": [], "created": 0, "key": "k"},
            id="an ID not a string",
        ),
    ],
)
def test_allocation_from_json_refuses_other_shapes(data: dict[str, object]) -> None:
    with pytest.raises(TypeError):
        Allocation.from_json(data)


PLACE = [  # (allocations added in order as (core, memory), the card(s) each gets)
    pytest.param([(30, 2)], [(0,)], id="a share: the lower card"),
    pytest.param([(30, 2), (30, 1)], [(0,), (0,)], id="shares pack onto a card in use"),
    pytest.param([(80, 1), (30, 1)], [(0,), (1,)], id="no room: the next card"),
    pytest.param([(100, 0), (100, 0)], [(0,), (1,)], id="whole cards"),
    pytest.param([(100, 0), (100, 0), (10, 1)], [(0,), (1,), ()], id="full: waits"),
    pytest.param([(30, 0)], [()], id="a first half is not placed"),
]


@pytest.mark.parametrize(("added", "cards"), PLACE)
def test_place(added: list[tuple[int, int]], cards: list[tuple[int, ...]]) -> None:
    book = ledger()
    records = []
    for n, (core, memory) in enumerate(added):
        record = share(core, memory, card=n % 2, key=f"k{n}", created=float(n))
        book.add(record)
        book.place(record)
        records.append(record)
    assert [r.cards for r in records] == cards
    assert {r.key for r in records if not r.cards} == book.unplaced
    used = {u.card.index: (u.core_used, u.memory_used) for u in book.usage()}
    for card in CARDS:
        on = [r for r in records if card in r.cards]
        core = sum(100 if r.whole_cards else len(r.core) for r in on)
        memory = sum(BLOCKS[card] if r.whole_cards else len(r.memory) for r in on)
        assert used[card] == (core, memory)


def test_drop_frees_the_card_and_the_ids() -> None:
    book = ledger()
    record = share(30, 2)
    book.add(record)
    book.place(record)
    assert book.find(record.core) is record
    assert book.drop("a", why="test") is record
    assert book.drop("a", why="again") is None
    assert book.find(record.core) is None
    assert [(u.core_used, u.memory_used) for u in book.usage()] == [(0, 0), (0, 0)]
    assert not book.owner


def test_waiting_is_oldest_first_and_leaves_out_the_pending_half() -> None:
    book = ledger()
    for key, created in (("new", 2.0), ("old", 1.0), ("pending", 0.0)):
        book.add(share(30, 2, key=key, created=created))
    book.add(share(30, 0, key="half"))  # not placeable: not waiting
    assert [a.key for a in book.waiting(None)] == ["pending", "old", "new"]
    assert [a.key for a in book.waiting("pending")] == ["old", "new"]
    book.place_waiting("pending")  # both fit on card 0
    assert [a.key for a in book.waiting(None)] == ["pending"]
    assert [a.cards for a in (book.allocations["old"], book.allocations["new"])] == [(0,), (0,)]


FIND = [
    pytest.param(["g0-c0", "g0-c1"], "a", id="all of one"),
    pytest.param(["g0-c0", "g1-c0"], None, id="two allocations"),
    pytest.param(["g0-c0", "g0-c50"], None, id="one ID held by none"),
    pytest.param([], None, id="no IDs"),
]


@pytest.mark.parametrize(("ids", "key"), FIND)
def test_find(ids: list[str], key: str | None) -> None:
    book = ledger()
    book.add(share(30, 2, key="a"))
    book.add(share(30, 2, card=1, key="b"))
    found = book.find(ids)
    assert (None if found is None else found.key) == key


def test_holders_once_each_in_order_but_for_those_kept() -> None:
    book = ledger()
    book.add(share(30, 2, key="a"))
    book.add(share(30, 2, card=1, key="b"))
    ids = ["g1-c0", "g0-c0", "g1-c1", "g5-c0"]
    assert book.holders(ids) == ["b", "a"]
    assert book.holders(ids, keep={"g1-c0", "g1-c1"}) == ["a"]


def test_first_and_complete() -> None:
    book = ledger()
    whole = book.first(Kind.CORE, [core_id(1, i) for i in range(100)], created=1.0)
    assert whole.cards == (0,)  # placed at once: whole cards need no memory
    record = book.first(Kind.MEMORY, [memory_id(0, 0)], created=2.0)
    assert (record.core, record.cards) == ((), ())
    record.verified = True
    book.complete(record, Kind.CORE, [core_id(0, i) for i in range(10)])
    assert (len(record.core), record.cards, record.verified) == (10, (1,), False)
    assert book.find(record.core) is record


def test_adopted_on_its_cards_or_where_there_is_room() -> None:
    book = ledger()
    on_one = book.adopted(["g0-c1", "g0-c0"], ["g0-m0"], [1, 9], created=0.0)
    assert (on_one.core, on_one.cards) == (("g0-c0", "g0-c1"), (1,))
    anywhere = book.adopted(["g0-c5"], ["g0-m3"], None, created=0.0)
    assert anywhere.cards == (1,)  # best fit: the card in use


RESTORE = [  # (the record's IDs' card, its cards, the cards after restore or None: ignored)
    pytest.param(0, (1,), (1,), id="on its card"),
    pytest.param(0, (7,), (0,), id="its card is gone: placed again"),
    pytest.param(7, (0,), None, id="IDs of a card that is gone: ignored"),
]


@pytest.mark.parametrize(("card", "cards", "after"), RESTORE)
def test_restore(card: int, cards: tuple[int, ...], after: tuple[int, ...] | None) -> None:
    book = ledger()
    book.restore([share(30, 2, card=card, cards=cards)])
    restored = book.allocations.get("a")
    assert (None if restored is None else restored.cards) == after


def test_health_and_sick_allocations() -> None:
    book = ledger()
    record = share(30, 2, cards=(1,))
    book.add(record)
    assert book.sick_keys() == set()
    assert not book.set_health(1, True, "")  # unchanged
    assert not book.set_health(9, False, "x")  # no such card
    assert book.set_health(1, False, "Xid 79")
    assert book.sick_keys() == {"a"}
    assert [(u.healthy, u.reason) for u in book.usage()] == [(True, ""), (False, "Xid 79")]
    assert not book.snapshot()[1].healthy
