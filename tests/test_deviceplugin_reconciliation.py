"""The ledger aligned with a PodResources listing (reconciliation.align), as tables."""

from __future__ import annotations

from collections.abc import Collection

import pytest

from deviceplugin.classic.allocation import Allocation
from deviceplugin.classic.ids import core_id, memory_id
from deviceplugin.classic.ledger import Ledger
from deviceplugin.classic.reconciliation import ADOPTED, Listing, align
from deviceplugin.classic.shown import ShownIds
from deviceplugin.shared.inventory import Card

CARDS = {i: Card(i, f"GPU-{i}", "Fake", 1024, i, None) for i in range(2)}
BLOCKS = {i: 4 for i in CARDS}
A = (frozenset(core_id(0, i) for i in range(30)), frozenset({memory_id(0, 0)}))
B = (frozenset(core_id(1, i) for i in range(20)), frozenset({memory_id(1, 0)}))


def ledger_with(*containers: tuple[frozenset[str], frozenset[str]], created: float) -> Ledger:
    book = Ledger(CARDS, BLOCKS, ShownIds(BLOCKS))
    for core, memory in containers:
        book.adopted(core, memory, None, created=created)
    return book


def held(book: Ledger) -> set[tuple[frozenset[str], frozenset[str]]]:
    return {(frozenset(a.core), frozenset(a.memory)) for a in book.allocations.values()}


def test_listing_of() -> None:
    listing = Listing.of([(A[0], A[1]), (set(), set()), (B[0], set())])
    assert listing.containers == [A, (B[0], frozenset())]
    assert listing.ids == A[0] | A[1] | B[0]


FREE = [  # (created, listed at, may free, seconds since the first miss, freed)
    pytest.param(0.0, 100.0, True, None, False, id="a first miss: noted, kept"),
    pytest.param(0.0, 100.0, True, 0.5, True, id="a second miss confirm_s later: freed"),
    pytest.param(0.0, 100.0, True, 0.2, False, id="a second miss too soon: kept"),
    pytest.param(99.0, 100.0, True, 0.5, False, id="younger than the grace: kept"),
    pytest.param(0.0, 100.0, False, 0.5, False, id="a listing not believed: kept"),
]


@pytest.mark.parametrize(("created", "at", "may_free", "since", "freed"), FREE)
def test_free_missing(
    created: float, at: float, may_free: bool, since: float | None, freed: bool
) -> None:
    book = ledger_with(A, created=created)
    kw = dict(grace_s=2.0, confirm_s=0.5, cards_of=None)
    if since is not None:
        align(book, Listing.of([]), at - since, may_free=True, **kw)  # type: ignore[arg-type]
    result = align(book, Listing.of([]), at, may_free=may_free, **kw)  # type: ignore[arg-type]
    assert bool(result.freed) is freed
    assert (not book.allocations) is freed
    assert result.unconfirmed == len(book.missing)
    assert not result.adopted


def test_a_listed_allocation_is_no_longer_missing() -> None:
    book = ledger_with(A, created=0.0)
    kw = dict(grace_s=2.0, confirm_s=0.5, may_free=True, cards_of=None)
    assert align(book, Listing.of([]), 100.0, **kw).unconfirmed == 1  # type: ignore[arg-type]
    assert align(book, Listing.of([A]), 100.1, **kw).unconfirmed == 0  # type: ignore[arg-type]
    assert not align(book, Listing.of([]), 100.6, **kw).freed  # type: ignore[arg-type]


ADOPT = [  # (recorded, listed, adopted)
    pytest.param([A], [A], [], id="listed as recorded: nothing"),
    pytest.param([A], [A, B], [B], id="unknown: adopted"),
    pytest.param([A], [(A[0], frozenset())], [(A[0], frozenset())], id="held differently"),
    pytest.param([], [B], [B], id="after a restart"),
]


@pytest.mark.parametrize(("recorded", "listed", "adopted"), ADOPT)
def test_adopt_unknown(recorded: list[tuple], listed: list[tuple], adopted: list[tuple]) -> None:
    book = ledger_with(*recorded, created=0.0)
    asked: list[Collection[str]] = []

    def cards_of(core: Collection[str]) -> Collection[int] | None:
        asked.append(core)
        return (1,)

    result = align(
        book,
        Listing.of(listed),
        100.0,
        grace_s=2.0,
        confirm_s=0.5,
        may_free=True,
        cards_of=cards_of,
    )
    assert [(frozenset(a.core), frozenset(a.memory)) for a in result.adopted] == adopted
    assert all(a.created == ADOPTED and a.cards == (1,) for a in result.adopted)
    assert asked == [core for core, _ in adopted]
    assert held(book) == set(listed)


def test_adopt_without_cards_of_places_where_there_is_room() -> None:
    book = ledger_with(created=0.0)
    result = align(
        book, Listing.of([B]), 100.0, grace_s=2.0, confirm_s=0.5, may_free=True, cards_of=None
    )
    (adopted,) = result.adopted
    assert isinstance(adopted, Allocation) and adopted.cards == (0,)
