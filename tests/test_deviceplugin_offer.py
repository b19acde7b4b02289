"""How many free IDs a node offers (offer.Offer): the ledger's cards, the pending half, the
floor, and nothing while a container waits."""

from __future__ import annotations

import pytest

from deviceplugin.classic.allocation import Allocation
from deviceplugin.classic.ids import Kind, core_id, memory_id
from deviceplugin.classic.ledger import Ledger
from deviceplugin.classic.offer import Offer
from deviceplugin.classic.pairing import Pairing
from deviceplugin.classic.shown import ShownIds
from deviceplugin.shared.inventory import Card

BLOCKS = {0: 4, 1: 4}
CARDS = {i: Card(i, f"GPU-{i}", "Fake", 1024, i, None) for i in BLOCKS}


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def node(settle_s: float = 0.0) -> tuple[Offer, Ledger, Pairing, Clock]:
    clock = Clock()
    shown = ShownIds(BLOCKS)
    ledger = Ledger(CARDS, BLOCKS, shown)
    pairing = Pairing(5.0, clock)
    return Offer(ledger, shown, pairing, settle_s, clock), ledger, pairing, clock


def add(ledger: Ledger, core: int, memory: int, key: str, *, group: int = 0) -> Allocation:
    """A container whose IDs are the first of ``group`` (IDs name no card: the ledger places
    it)."""
    record = Allocation(
        core=tuple(core_id(group, i) for i in range(core)),
        memory=tuple(memory_id(group, i) for i in range(memory)),
        cards=(),
        created=0.0,
        key=key,
    )
    ledger.add(record)
    ledger.place(record)
    return record


OFFERS = [  # (containers as (core, memory), open card, core offered, memory offered)
    pytest.param([], None, 200, 8, id="two free cards"),
    pytest.param([(30, 1)], 0, 170, 7, id="a share: its card stays open"),
    pytest.param([(100, 0)], None, 100, 4, id="a whole card: the other"),
    pytest.param([(60, 4)], None, 100, 4, id="no memory left: the core is stranded"),
]


@pytest.mark.parametrize(("containers", "open_card", "core", "memory"), OFFERS)
def test_update_and_now(
    containers: list[tuple[int, int]], open_card: int | None, core: int, memory: int
) -> None:
    offer, ledger, _, _ = node()
    for n, (c, m) in enumerate(containers):
        add(ledger, c, m, f"k{n}", group=n)
    offer.update(settle=True, drop_floors=False)
    assert offer.open_card == open_card
    assert (offer.now(Kind.CORE), offer.now(Kind.MEMORY)) == (core, memory)
    assert (offer.listed(Kind.CORE), offer.listed(Kind.MEMORY)) == (core, memory)


def test_nothing_is_offered_while_a_container_waits() -> None:
    offer, ledger, _, _ = node()
    add(ledger, 60, 3, "a")
    add(ledger, 60, 3, "b", group=1)
    waits = Allocation(
        core=tuple(core_id(0, i) for i in range(60, 90)),
        memory=(memory_id(0, 3), memory_id(1, 3)),  # 40 core left on each card, one block
        cards=(),
        created=0.0,
        key="waits",
    )
    ledger.add(waits)
    assert not ledger.place(waits)
    offer.update(settle=True, drop_floors=False)
    assert [a.key for a in ledger.waiting(None)] == ["waits"]
    assert (offer.now(Kind.CORE), offer.now(Kind.MEMORY)) == (0, 0)


def test_a_pending_half_takes_its_ids_off_and_holds_the_other_count() -> None:
    offer, ledger, pairing, _ = node()
    offer.update(settle=True, drop_floors=False)
    half = add(ledger, 30, 0, "half")  # a share's first call: not placed yet
    pairing.begin(Kind.CORE, half.key, 30, hold=8)
    assert offer.now(Kind.CORE) == 200 - 30
    add(ledger, 100, 0, "whole")  # placed meanwhile: the count seen at the first call holds
    assert offer.now(Kind.MEMORY) == 8


def test_a_fall_is_kept_listed_for_the_moment() -> None:
    offer, ledger, _, clock = node(settle_s=2.0)
    add(ledger, 30, 1, "a")
    offer.update(settle=True, drop_floors=False)  # 30 allocated + 170 offered: 200 listed
    add(ledger, 80, 1, "b", group=1)
    offer.update(settle=True, drop_floors=False)
    # card 1 was entirely free and now hides: only card 0's 70 are offered, beside 110
    assert ledger.allocations["b"].cards == (1,)
    listed = lambda: (offer.listed(Kind.CORE, node=True), offer.listed(Kind.CORE))  # noqa: E731
    assert offer.now(Kind.CORE) == 70
    assert listed() == (90, 90)  # the 200 kept: 90 free beside 110
    clock.now += 2.0
    assert listed() == (70, 90)  # the Node's moment is over, the lists' is not
    clock.now += 2.0
    assert listed() == (70, 70)


def test_a_failed_card_withdraws_its_capacity_at_once() -> None:
    offer, ledger, _, _ = node(settle_s=2.0)
    offer.update(settle=True, drop_floors=False)
    ledger.set_health(1, False, "Xid 79")
    offer.update(settle=True, drop_floors=True)
    assert not offer.floors.floors
    assert offer.listed(Kind.CORE) == offer.now(Kind.CORE) == 100
