"""Placement policy as tables: what a node advertises and which card a container gets.

Pure functions over hand-written card states: no allocator, no lock, no kubelet.
"""

from __future__ import annotations

import pytest

from deviceplugin.ids import Kind
from deviceplugin.placement import (
    CardState,
    Pending,
    advertised,
    choose_cards,
    numa_pick,
    open_partial_card,
    pick_ids,
    whole_cards_needed,
)

B = 96  # memory blocks of a 24 GiB card


def card(index: int, core: int = 0, memory: int = 0, **kw: object) -> CardState:
    return CardState(index, B, core, memory, **kw)  # type: ignore[arg-type]


def free_of(cards: list[CardState], kind: Kind, shown: frozenset[int]) -> dict[int, int]:
    """What kubelet offers: the free IDs of the cards whose free IDs are listed."""
    return {c.index: c.free(kind) for c in cards if c.index in shown and c.free(kind)}


OPEN_CARD = [
    pytest.param([card(0), card(1)], None, None, id="no card in use: none"),
    pytest.param([card(0, 60, 40), card(1)], None, 0, id="the one partly used card"),
    pytest.param([card(0, 60, 40), card(1, 30, 40)], None, 1, id="most free core"),
    pytest.param([card(0, 60, 40), card(1, 60, 10)], None, 1, id="ties: most free memory"),
    pytest.param([card(0, 60, 40), card(1, 60, 40)], None, 0, id="ties: lower index"),
    pytest.param([card(0, 60, 40), card(1, 60, 40)], 1, 1, id="among equals the open one stays"),
    pytest.param([card(0, 90, 40), card(1, 30, 40)], 0, 1, id="more free core elsewhere: it moves"),
    pytest.param([card(0, 100, 40), card(1, 30, 40)], 0, 1, id="a full open card hands over"),
    pytest.param([card(0, 60, B), card(1, 90, 1)], None, 1, id="no free memory: cannot host"),
    pytest.param([card(0, 10, 1, healthy=False), card(1, 90, 1)], None, 1, id="unhealthy: no"),
]


@pytest.mark.parametrize(("cards", "current", "expected"), OPEN_CARD)
def test_open_partial_card(cards: list[CardState], current: int | None, expected: int) -> None:
    assert open_partial_card(cards, current) == expected


def test_a_pending_half_keeps_the_open_card() -> None:
    # card 1's first half took memory: by the counts card 0 would now be the open card
    cards = [card(0, 60, 40), card(1, 60, 60)]
    assert open_partial_card(cards, 1) == 0
    assert open_partial_card(cards, 1, keep=True) == 1


# (cards, kind, open card, pending half, cards whose free IDs of that kind are listed)
ADVERTISED = [
    pytest.param([card(0), card(1)], Kind.CORE, None, None, {0, 1}, id="free cards"),
    pytest.param(
        [card(i, 60, 40) for i in range(4)], Kind.CORE, 0, None, {0}, id="one partly used card"
    ),
    pytest.param(
        [card(0, 60, 40), card(1, 60, 40), card(2)], Kind.MEMORY, 0, None, {0, 2},
        id="the open card and the free ones",
    ),
    pytest.param([card(0, 100, 10)], Kind.MEMORY, None, None, set(), id="no core: memory hidden"),
    pytest.param([card(0, 10, B)], Kind.CORE, None, None, set(), id="no memory: core hidden"),
    pytest.param(
        [card(0, 100, 0), card(1, 60, 40)], Kind.MEMORY, 1, Pending(Kind.CORE, frozenset({0})),
        {0, 1}, id="a pending core half keeps its card's memory listed",
    ),
    pytest.param(
        [card(0, 30, 10), card(1, 60, 40)], Kind.CORE, 0, Pending(Kind.CORE, frozenset({1})),
        {0}, id="a pending half lists only the other resource",
    ),

    pytest.param([card(0, healthy=False), card(1)], Kind.CORE, None, None, {1}, id="unhealthy"),
]  # fmt: skip


@pytest.mark.parametrize(("cards", "kind", "open_card", "pending", "expected"), ADVERTISED)
def test_advertised(
    cards: list[CardState],
    kind: Kind,
    open_card: int | None,
    pending: Pending | None,
    expected: set[int],
) -> None:
    assert advertised(cards, kind, open_card=open_card, pending=pending) == expected


# (running cards, request core, request memory): the sums the scheduler sees fit exactly when
# one card (or k entirely free cards) can host the request
SCHEDULER_SUMS = [
    pytest.param([card(i, 60, 40) for i in range(4)], 50, 20, id="0.6 on each of four, 0.5 pod"),
    pytest.param([card(i, 60, 40) for i in range(4)], 40, 20, id="0.6 on each of four, 0.4 pod"),
    pytest.param([card(0, 60, 40), card(1)], 50, 20, id="a free card beside a partly used one"),
    pytest.param([card(0, 30, 10), card(1), card(2)], 200, 2 * B, id="two whole beside one share"),
    pytest.param([card(0, 30, 10), card(1, 1, 1), card(2)], 200, 2 * B, id="only one whole free"),
    pytest.param([card(0, 30, 10), card(1), card(2)], 200, 0, id="whole cards without memory"),
    pytest.param([card(0, 1, 95), card(1, 99, 1)], 1, 1, id="one ID of each left, on two cards"),
]


@pytest.mark.parametrize(("cards", "core", "memory"), SCHEDULER_SUMS)
def test_what_the_scheduler_sums_fits_one_card(
    cards: list[CardState], core: int, memory: int
) -> None:
    open_card = open_partial_card(cards)
    core_shown = advertised(cards, Kind.CORE, open_card=open_card)
    memory_shown = advertised(cards, Kind.MEMORY, open_card=open_card)
    fits_sums = (
        sum(free_of(cards, Kind.CORE, core_shown).values()) >= core
        and sum(free_of(cards, Kind.MEMORY, memory_shown).values()) >= memory
    )
    if core >= 100:
        whole = [c for c in cards if c.entirely_free]
        fits_cards = len(whole) >= core // 100
    else:
        fits_cards = any(c.free(Kind.CORE) >= core and c.free(Kind.MEMORY) >= memory for c in cards)
    assert fits_sums == fits_cards


# (case, kind, size, free per card, cards, keywords, expected cards)
CHOICES = [
    pytest.param(Kind.CORE, 40, {0: 40, 1: 100}, [card(0, 60, 40), card(1)], {}, [0],
                 id="best fit packs onto the partly used card"),
    pytest.param(Kind.CORE, 50, {0: 40, 1: 100}, [card(0, 60, 40), card(1)], {}, [1],
                 id="a share that does not fit goes to a free card"),
    pytest.param(Kind.MEMORY, 10, {0: 56, 1: 96}, [card(0, 60, 40), card(1)],
                 {"other_size": 50}, [1], id="the learnt other size must fit too"),
    pytest.param(Kind.MEMORY, 10, {0: 56, 1: 96}, [card(0, 60, 40), card(1)], {}, [0],
                 id="without it, the best fit"),
    pytest.param(Kind.MEMORY, 10, {0: 56, 1: 96}, [card(0, 60, 40), card(1)],
                 {"other_size": 101}, [0], id="a learnt size that fits nowhere says nothing"),
    pytest.param(Kind.CORE, 30, {0: 70, 1: 100}, [card(0, 30, 10), card(1)],
                 {"allowed": {1}}, [1], id="only cards advertised now"),
    pytest.param(Kind.CORE, 30, {0: 70, 1: 100}, [card(0, 30, 10), card(1)],
                 {"allowed": {1}, "must": {0}}, [0], id="must-include IDs pin their card"),
    pytest.param(Kind.MEMORY, 20, {0: 56, 1: 96}, [card(0, 60, 40), card(1)],
                 {"pending": Pending(Kind.CORE, frozenset({1}))}, [1],
                 id="the second resource follows the first"),
    pytest.param(Kind.CORE, 200, {0: 70, 1: 100, 2: 100, 3: 100},
                 [card(0, 30, 10), card(1, numa_node=0), card(2, numa_node=1),
                  card(3, numa_node=1)], {}, [2, 3], id="whole cards on one NUMA node"),
    pytest.param(Kind.CORE, 100, {0: 100, 1: 100}, [card(0, 0, 10), card(1)], {}, [1],
                 id="a whole card is an entirely free card"),
    pytest.param(Kind.CORE, 200, {0: 70, 1: 100}, [card(0, 30, 10), card(1)], {}, [],
                 id="not enough whole cards: no preference"),
    pytest.param(Kind.MEMORY, 2 * B, {1: B, 2: B}, [card(0, 30, 10), card(1), card(2)], {},
                 [1, 2], id="memory of whole cards"),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "size", "free", "cards", "keywords", "expected"), CHOICES)
def test_choose_cards(
    *,
    kind: Kind,
    size: int,
    free: dict[int, int],
    cards: list[CardState],
    keywords: dict[str, object],
    expected: list[int],
) -> None:
    by_index = {c.index: c for c in cards}
    assert choose_cards(kind, size, free, by_index, **keywords) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kind", "size", "whole", "expected"),
    [
        pytest.param(Kind.CORE, 300, [card(0)], 3, id="core in hundreds"),
        pytest.param(Kind.CORE, 30, [card(0)], 0, id="a share"),
        pytest.param(Kind.MEMORY, B, [card(0)], 1, id="all of one card's memory"),
        pytest.param(Kind.MEMORY, B, [], 0, id="no free card: a share of a bigger one"),
        pytest.param(Kind.MEMORY, 10, [card(0)], 0, id="memory share"),
    ],
)
def test_whole_cards_needed(kind: Kind, size: int, whole: list[CardState], expected: int) -> None:
    assert whole_cards_needed(kind, size, whole) == expected


@pytest.mark.parametrize(
    ("whole", "need", "numa", "expected"),
    [
        pytest.param([0, 1, 2, 3], 2, {0: 0, 1: 0, 2: 1, 3: 1}, [0, 1], id="first fitting node"),
        pytest.param([1, 2, 3], 2, {1: 0, 2: 1, 3: 1}, [2, 3], id="the node that has them"),
        pytest.param([1, 2, 3], 3, {1: 0, 2: 1, 3: 1}, [2, 3, 1], id="spans nodes when it must"),
        pytest.param([0, 1], 1, {0: None, 1: None}, [0], id="no NUMA information"),
    ],
)
def test_numa_pick(
    whole: list[int], need: int, numa: dict[int, int | None], expected: list[int]
) -> None:
    assert numa_pick(whole, need, numa) == expected


def test_pick_ids_takes_must_include_first_and_all_of_whole_cards() -> None:
    cards = {0: card(0), 1: card(1)}
    picked = pick_ids(Kind.CORE, 3, [0], free={0: [5, 1, 2, 9]}, must={0: [9]}, cards=cards)
    assert picked == [(0, 9), (0, 1), (0, 2)]
    whole = pick_ids(
        Kind.CORE, 200, [0, 1], free={0: range(100), 1: range(100)}, must={}, cards=cards
    )
    assert len(whole) == 200


def test_pick_ids_that_do_not_add_up_are_no_preference() -> None:
    assert pick_ids(Kind.CORE, 5, [0], free={0: [1, 2]}, must={}, cards={0: card(0)}) == []
