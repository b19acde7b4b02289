"""The pairing of a container's two Allocate calls (pairing): halves, partners, the offer."""

from __future__ import annotations

import pytest

from deviceplugin.classic.allocation import Allocation
from deviceplugin.classic.ids import Kind
from deviceplugin.classic.pairing import (
    WHOLE_CORE_PAIR_S,
    Half,
    Pairing,
    pending_offer,
    whole_cards_memory,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_half_waits_for_its_window_and_then_expires() -> None:
    clock = Clock()
    pairing = Pairing(5.0, clock)
    assert pairing.pending is None and pairing.pending_key is None
    assert pairing.seconds_left() is None
    pairing.begin(Kind.CORE, "a", 30, hold=7)
    assert pairing.pending == Half(Kind.CORE, "a", 30, 105.0, 7)
    assert pairing.pending_key == "a"
    clock.now = 104.0
    assert pairing.seconds_left() == 1.0
    assert not pairing.expire()
    clock.now = 105.0
    assert pairing.expire()
    assert pairing.pending is None


@pytest.mark.parametrize(
    ("window", "asked", "deadline"),
    [
        pytest.param(5.0, None, 105.0, id="the pairing's window"),
        pytest.param(5.0, WHOLE_CORE_PAIR_S, 100.0 + WHOLE_CORE_PAIR_S, id="a shorter one"),
        pytest.param(0.2, WHOLE_CORE_PAIR_S, 100.2, id="never longer than the pairing's"),
    ],
)
def test_the_window_of_a_half(window: float, asked: float | None, deadline: float) -> None:
    pairing = Pairing(window, Clock())
    pairing.begin(Kind.CORE, "a", 100, window_s=asked)
    assert pairing.pending is not None
    assert pairing.pending.deadline == pytest.approx(deadline)


@pytest.mark.parametrize(
    ("first", "second", "pairs"),
    [
        pytest.param(Kind.CORE, Kind.MEMORY, True, id="core then memory"),
        pytest.param(Kind.MEMORY, Kind.CORE, True, id="memory then core"),
        pytest.param(Kind.CORE, Kind.CORE, False, id="core twice: another container"),
        pytest.param(None, Kind.CORE, False, id="nothing pending"),
    ],
)
def test_partner_of(first: Kind | None, second: Kind, pairs: bool) -> None:
    pairing = Pairing(5.0, Clock())
    if first is not None:
        pairing.begin(first, "a", 10)
    assert (pairing.partner_of(second) is not None) is pairs


def record(core: int, memory: int, cards: tuple[int, ...] = ()) -> Allocation:
    return Allocation(
        core=tuple(f"g0-c{i}" for i in range(core)),
        memory=tuple(f"g0-m{i}" for i in range(memory)),
        cards=cards,
        created=0.0,
        key="a",
    )


BLOCKS = {0: 96, 1: 64}

PARTNER = [
    pytest.param(record(30, 0), Kind.MEMORY, 3, True, id="a share's memory"),
    pytest.param(record(0, 3), Kind.CORE, 30, True, id="a share's core"),
    pytest.param(record(100, 0, (1,)), Kind.MEMORY, 64, True, id="all of the whole card's memory"),
    pytest.param(record(100, 0, (1,)), Kind.MEMORY, 3, False, id="less: the next container"),
    pytest.param(record(100, 0), Kind.MEMORY, 96, True, id="unplaced: the largest card's"),
    pytest.param(record(200, 0, (0, 1)), Kind.MEMORY, 160, True, id="two cards' memory"),
]


@pytest.mark.parametrize(("first", "kind", "size", "pairs"), PARTNER)
def test_partner(first: Allocation, kind: Kind, size: int, pairs: bool) -> None:
    pairing = Pairing(5.0, Clock())
    first_kind = Kind.MEMORY if kind is Kind.CORE else Kind.CORE
    pairing.begin(first_kind, first.key, 1)
    found = pairing.partner(kind, size, {first.key: first}, BLOCKS)
    assert (found is first) is pairs
    # a call that does not complete the half ends it: it is the next container's first (one
    # that does leaves the ending to the allocator, which completes the container first)
    assert (pairing.pending is None) is not pairs


def test_a_partner_that_is_gone_pairs_nothing_and_keeps_the_half() -> None:
    pairing = Pairing(5.0, Clock())
    pairing.begin(Kind.CORE, "gone", 30)
    assert pairing.partner(Kind.MEMORY, 3, {}, BLOCKS) is None
    assert pairing.pending_key == "gone"


@pytest.mark.parametrize(
    ("cards", "whole", "expected"),
    [
        pytest.param((0,), 1, 96, id="its card"),
        pytest.param((0, 1), 2, 160, id="its cards"),
        pytest.param((), 2, 192, id="unplaced: the largest card's, each"),
    ],
)
def test_whole_cards_memory(cards: tuple[int, ...], whole: int, expected: int) -> None:
    assert whole_cards_memory(cards, whole, BLOCKS) == expected


PENDING = [
    pytest.param(Kind.CORE, Kind.CORE, True, 0, 70, id="own kind, unplaced: taken off"),
    pytest.param(Kind.CORE, Kind.CORE, False, 0, 100, id="own kind, placed: in the ledger"),
    pytest.param(Kind.CORE, Kind.MEMORY, True, 50, 100, id="other kind: the count it saw"),
    pytest.param(Kind.CORE, Kind.MEMORY, True, 10, 140, id="other kind: kept from shrinking"),
]


@pytest.mark.parametrize(("half_kind", "kind", "unplaced", "owned", "expected"), PENDING)
def test_pending_offer(
    half_kind: Kind, kind: Kind, unplaced: bool, owned: int, expected: int
) -> None:
    half = Half(half_kind, "a", 30, 0.0, hold=150)
    assert pending_offer(100, kind, half, unplaced=unplaced, owned=owned) == expected


def test_pending_offer_never_falls_below_zero() -> None:
    half = Half(Kind.CORE, "a", 30, 0.0)
    assert pending_offer(20, Kind.CORE, half, unplaced=True, owned=0) == 0
