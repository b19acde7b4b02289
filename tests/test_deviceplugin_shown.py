"""Which IDs the ListAndWatch lists show Healthy (shown.ShownIds), per group."""

from __future__ import annotations

from collections.abc import Collection, Mapping

import pytest

from deviceplugin.classic.ids import DeviceId, Kind, memory_id
from deviceplugin.classic.shown import ShownIds

BLOCKS = {0: 4, 1: 4}  # two cards of four memory blocks each


def healthy(
    shown: ShownIds,
    kind: Kind,
    target: int,
    *,
    owner: Mapping[str, str] | None = None,
    sick: Collection[str] = (),
) -> list[str]:
    _, lists = shown.listing(kind, target, owner=owner or {}, sick_keys=sick)
    return [d.id for group in lists for d in group if d.healthy]


SHOW = [  # (allocated memory IDs, free IDs to show, the Healthy IDs)
    pytest.param([], 0, [], id="nothing"),
    pytest.param([], 3, ["g0-m0", "g0-m1", "g0-m2"], id="the lowest free first"),
    pytest.param([], 6, [*(f"g0-m{i}" for i in range(4)), "g1-m0", "g1-m1"], id="across groups"),
    pytest.param([(0, 1)], 2, ["g0-m0", "g0-m1", "g0-m2"], id="allocated plus free"),
    pytest.param(
        [(0, 0), (0, 1), (0, 2), (0, 3)],
        1,
        [*(f"g0-m{i}" for i in range(4)), "g1-m0"],
        id="a full group is skipped",
    ),
]


@pytest.mark.parametrize(("allocated", "target", "expected"), SHOW)
def test_listing(allocated: list[tuple[int, int]], target: int, expected: list[str]) -> None:
    shown = ShownIds(BLOCKS)
    for card, number in allocated:
        shown.take(DeviceId(card, Kind.MEMORY, number))
    assert healthy(shown, Kind.MEMORY, target) == expected
    assert shown.shown_count(Kind.MEMORY) == target
    assert shown.owned_count(Kind.MEMORY) == len(allocated)
    assert healthy(shown, Kind.CORE, 0) == []


def test_a_shown_id_taken_changes_no_list() -> None:
    shown = ShownIds(BLOCKS)
    signature, lists = shown.listing(Kind.MEMORY, 3, owner={}, sick_keys=set())
    shown.take(DeviceId(0, Kind.MEMORY, 1))  # kubelet allocated a shown free ID
    again, lists_again = shown.listing(Kind.MEMORY, 2, owner={}, sick_keys=set())
    assert again == signature
    assert all(a is b for a, b in zip(lists, lists_again, strict=True))


def test_fewer_drops_the_highest_shown_first() -> None:
    shown = ShownIds(BLOCKS)
    healthy(shown, Kind.MEMORY, 6)
    assert healthy(shown, Kind.MEMORY, 2) == ["g0-m0", "g0-m1"]


def test_a_released_id_is_free_again() -> None:
    shown = ShownIds(BLOCKS)
    taken = DeviceId(1, Kind.MEMORY, 2)
    shown.take(taken)
    assert healthy(shown, Kind.MEMORY, 0) == ["g1-m2"]
    shown.release(taken)
    assert healthy(shown, Kind.MEMORY, 0) == []
    assert shown.owned_count(Kind.MEMORY) == 0


def test_ids_of_a_sick_allocation_are_unhealthy() -> None:
    shown = ShownIds(BLOCKS)
    for number in (0, 1):
        shown.take(DeviceId(0, Kind.MEMORY, number))
    owner = {memory_id(0, 0): "sick", memory_id(0, 1): "well"}
    assert healthy(shown, Kind.MEMORY, 0, owner=owner) == ["g0-m0", "g0-m1"]
    assert healthy(shown, Kind.MEMORY, 0, owner=owner, sick={"sick"}) == ["g0-m1"]
    # its card works again: its IDs are Healthy again, though no ID changed hands
    assert healthy(shown, Kind.MEMORY, 0, owner=owner) == ["g0-m0", "g0-m1"]


def test_ids_of_unknown_cards_are_ignored() -> None:
    shown = ShownIds(BLOCKS)
    shown.take(DeviceId(7, Kind.MEMORY, 0))
    shown.release(DeviceId(7, Kind.MEMORY, 0))
    assert shown.owned_count(Kind.MEMORY) == 0
