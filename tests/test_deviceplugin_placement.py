"""Placement policy as tables: what a node advertises and which card a container gets.

Pure functions over hand-written card states: no allocator, no lock, no kubelet.
"""

from __future__ import annotations

import pytest

from core.placement import numa_pick
from deviceplugin.classic.ids import Kind
from deviceplugin.classic.placement import (
    CardState,
    advertised,
    offered,
    open_partial_card,
    place,
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


# (cards, kind, open card, cards whose free capacity of that kind is offered)
ADVERTISED = [
    pytest.param([card(0), card(1)], Kind.CORE, None, {0, 1}, id="free cards"),
    pytest.param([card(i, 60, 40) for i in range(4)], Kind.CORE, 0, {0}, id="one partly used card"),
    pytest.param(
        [card(0, 60, 40), card(1, 60, 40), card(2)], Kind.MEMORY, 0, {0, 2},
        id="the open card and the free ones",
    ),
    pytest.param([card(0, 100, 10)], Kind.MEMORY, None, set(), id="no core: memory hidden"),
    pytest.param([card(0, 10, B)], Kind.CORE, None, set(), id="no memory: core hidden"),
    pytest.param([card(0, healthy=False), card(1)], Kind.CORE, None, {1}, id="unhealthy"),
]  # fmt: skip


@pytest.mark.parametrize(("cards", "kind", "open_card", "expected"), ADVERTISED)
def test_advertised(
    cards: list[CardState], kind: Kind, open_card: int | None, expected: set[int]
) -> None:
    assert advertised(cards, kind, open_card=open_card) == expected
    assert offered(cards, kind, open_card=open_card) == sum(
        c.free(kind) for c in cards if c.index in expected
    )


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


# (cards, core, memory, the card(s) the container gets)
PLACES = [
    pytest.param([card(0, 60, 40), card(1)], 40, 20, [0], id="best fit: the partly used card"),
    pytest.param([card(0, 60, 40), card(1)], 50, 20, [1], id="does not fit there: a free card"),
    pytest.param([card(0, 60, 90), card(1)], 10, 10, [1], id="its memory does not fit there"),
    pytest.param(
        [card(0, 50, 40), card(1, 80, 40), card(2)], 20, 20, [1], id="the least left after it"
    ),
    pytest.param(
        [card(0, 60, 40), card(1, 90, 10), card(2, 95, 5)], 10, 10, [1],
        id="any card that fits, offered or hidden",
    ),
    pytest.param([card(0, 60, 40), card(1, 70, 40)], 50, 20, [], id="fits no card: none"),
    pytest.param([card(0, 10, 1), card(1), card(2)], 200, 0, [1, 2], id="whole: entirely free"),
    pytest.param([card(0, 10, 1), card(1), card(2, 1, 0)], 200, 0, [], id="whole: one free"),
    pytest.param([card(0, healthy=False), card(1)], 100, 0, [1], id="whole: healthy only"),
    pytest.param([card(0, healthy=False)], 10, 10, [], id="share: healthy only"),
    pytest.param([card(0)], 150, 10, [], id="neither a share nor whole cards"),
]  # fmt: skip


@pytest.mark.parametrize(("cards", "core", "memory", "expected"), PLACES)
def test_place(cards: list[CardState], core: int, memory: int, expected: list[int]) -> None:
    assert place({c.index: c for c in cards}, core, memory) == expected


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
