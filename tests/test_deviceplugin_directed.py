"""The extender placement mode in the allocator: every ID of every healthy card is listed,
Allocate places nothing, and a container goes where its record directs it, or waits."""

from __future__ import annotations

import pytest

from deviceplugin.classic.allocation import Allocation
from deviceplugin.classic.allocator import Allocator
from deviceplugin.classic.directed import DirectedAllocator, choose_directed, fit_exactly
from deviceplugin.classic.ids import Kind
from deviceplugin.classic.placement import CardState
from deviceplugin.classic.reconciliation import ADOPTED
from deviceplugin.shared.inventory import Card
from tests.test_deviceplugin_allocator import Clock, free, healthy, take

BLOCKS = 16  # 4096 MiB cards


def make(count: int = 4) -> DirectedAllocator:
    cards = [Card(i, f"GPU-{i}", "Fake", 4096, i, None) for i in range(count)]
    return DirectedAllocator(cards, clock=Clock(), wall=Clock())


def held(alloc: Allocator, ids: list[str]) -> Allocation:
    found = alloc.find(Kind.CORE, [i for i in ids if "-c" in i])
    assert found is not None
    return found


def card(index: int, core: int = 0, memory: int = 0, *, healthy: bool = True) -> CardState:
    return CardState(index, BLOCKS, core, memory, healthy)


FITS = [
    pytest.param([card(0, 40, 4)], (0,), 60, 12, [0], id="a-share-that-fits-its-card-exactly"),
    pytest.param([card(0, 41, 4)], (0,), 60, 12, [], id="core-short-by-one"),
    pytest.param([card(0, 40, 5)], (0,), 60, 12, [], id="memory-short-by-one"),
    pytest.param([card(0), card(1)], (1,), 10, 1, [1], id="the-named-card-not-the-best-fit"),
    pytest.param([card(0, healthy=False)], (0,), 10, 1, [], id="a-failed-card-waits"),
    pytest.param([card(0)], (3,), 10, 1, [], id="a-card-the-node-lacks"),
    pytest.param([card(0), card(1)], (0, 1), 10, 1, [], id="a-share-on-two-cards"),
    pytest.param([card(0), card(1)], (1, 0), 200, 0, [0, 1], id="two-whole-cards"),
    pytest.param([card(0), card(1, 1, 0)], (0, 1), 200, 0, [], id="whole-cards-one-in-use"),
    pytest.param([card(0), card(1)], (0,), 200, 0, [], id="whole-cards-fewer-named"),
]  # fmt: skip


@pytest.mark.parametrize(("cards", "target", "core", "memory", "expected"), FITS)
def test_a_directed_container_fits_exactly_its_cards(
    cards: list[CardState], target: tuple[int, ...], core: int, memory: int, expected: list[int]
) -> None:
    assert fit_exactly({c.index: c for c in cards}, target, core, memory) == expected


CHOICES = [
    pytest.param(None, 1.0, [], id="not-directed-yet-waits-for-its-record"),
    pytest.param(None, ADOPTED, [], id="adopted-without-limits-waits-for-its-record-too"),
    pytest.param((), 1.0, [0], id="no-record-best-fit"),
    pytest.param((1,), 1.0, [1], id="its-record"),
]  # fmt: skip


@pytest.mark.parametrize(("directed", "created", "expected"), CHOICES)
def test_who_chooses_the_card(
    directed: tuple[int, ...] | None, created: float, expected: list[int]
) -> None:
    cards = {0: card(0, 50, 8), 1: card(1)}
    allocation = Allocation(("g0-c0",), ("g0-m0",), (), created, directed=directed)
    assert choose_directed(cards, allocation) == expected


def test_every_id_of_every_healthy_card_is_listed_whatever_is_allocated() -> None:
    alloc = make(4)
    for core, memory in [(50, 8), (30, 2), (70, 4), (10, 1)]:
        take(alloc, core, memory)
        assert len(healthy(alloc, Kind.CORE)) == 400
        assert len(healthy(alloc, Kind.MEMORY)) == 4 * BLOCKS
        assert not alloc.keeping() and alloc.over_offered(Kind.CORE) == 0
    whole = free(alloc, Kind.CORE)[:200]  # whole cards come without memory
    alloc.allocate(Kind.CORE, whole, "fracgpu.io/core")
    assert len(healthy(alloc, Kind.CORE)) == 400
    assert all(not a.cards for a in alloc.allocations())  # Allocate places nothing


def test_a_directed_container_is_placed_on_its_card_or_waits_until_it_has_room() -> None:
    alloc = make(2)
    first = held(alloc, take(alloc, 60, 8))
    second = held(alloc, take(alloc, 60, 8))
    assert alloc.direct(first, (1,))
    assert not alloc.direct(second, (1,))  # card 1 cannot hold both: the second waits
    assert [(u.core_used, u.memory_used) for u in alloc.usage()] == [(0, 0), (60, 8)]
    alloc.reconcile([(second.core, second.memory)], 2000.0, grace_s=0, confirm_s=0)
    assert second.cards == (1,)  # the first ended: the waiting one is placed at once


def test_a_failed_card_withdraws_its_capacity_and_its_containers_ids() -> None:
    alloc = make(2)
    allocation = held(alloc, take(alloc, 30, 4))
    assert alloc.direct(allocation, (1,))
    alloc.set_health(1, False, "XID 79")
    assert len(healthy(alloc, Kind.CORE)) == 100
    assert not set(allocation.core) & healthy(alloc, Kind.CORE)
    assert len(free(alloc, Kind.MEMORY)) == BLOCKS
    alloc.set_health(1, True)
    assert len(healthy(alloc, Kind.CORE)) == 200
