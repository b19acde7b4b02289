"""The settling moment (settling.Floors): a change that hides capacity keeps the count listed."""

from __future__ import annotations

import pytest

from deviceplugin.classic.ids import Kind
from deviceplugin.classic.settling import Floor, Floors

S = 2.0  # the moment: the Node's allocatable for S, kubelet's lists for 2 S


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def floors_after(listed: int, settle_s: float = S) -> tuple[Floors, Clock]:
    """Floors that saw ``listed`` Healthy core IDs (10 allocated) at the last change."""
    clock = Clock()
    floors = Floors(settle_s, clock)
    floors.note(Kind.CORE, 10, listed - 10, settle=True, drop=False, now=clock())
    return floors, clock


NOTE = [
    pytest.param(dict(settle=True, drop=False), 10, 30, Floor(100, 52.0, 54.0), id="a fall: kept"),
    pytest.param(dict(settle=True, drop=False), 10, 90, None, id="no fall: nothing kept"),
    pytest.param(dict(settle=True, drop=False), 10, 95, None, id="a rise: nothing kept"),
    pytest.param(dict(settle=False, drop=False), 10, 30, None, id="a moment ended: none"),
    pytest.param(dict(settle=True, drop=True), 10, 30, None, id="a card failed: none"),
]


@pytest.mark.parametrize(("how", "owned", "offered_now", "floor"), NOTE)
def test_note(how: dict[str, bool], owned: int, offered_now: int, floor: Floor | None) -> None:
    floors, clock = floors_after(100)
    floors.note(Kind.CORE, owned, offered_now, now=clock(), **how)
    assert floors.floors.get(Kind.CORE) == floor
    assert Kind.MEMORY not in floors.floors


def test_no_moment_keeps_nothing() -> None:
    floors, clock = floors_after(100, settle_s=0.0)
    floors.note(Kind.CORE, 10, 30, settle=True, drop=False, now=clock())
    assert not floors.floors


def test_a_second_fall_keeps_the_higher_count() -> None:
    floors, clock = floors_after(100)
    floors.note(Kind.CORE, 10, 30, settle=True, drop=False, now=clock())  # listed: kept 100
    clock.now += 1
    floors.note(Kind.CORE, 10, 0, settle=True, drop=False, now=clock())
    assert floors.floors[Kind.CORE] == Floor(100, 53.0, 55.0)


OFFERED = [  # (seconds after the fall, offered on the Node, offered in the lists)
    pytest.param(0.0, 90, 90, id="at once: both keep it"),
    pytest.param(1.9, 90, 90, id="within the Node's moment"),
    pytest.param(2.0, 30, 90, id="the Node's moment over: the lists keep it"),
    pytest.param(4.0, 30, 30, id="both over"),
]


@pytest.mark.parametrize(("after", "node", "lists"), OFFERED)
def test_offered(after: float, node: int, lists: int) -> None:
    floors, clock = floors_after(100)
    floors.note(Kind.CORE, 10, 30, settle=True, drop=False, now=clock())
    clock.now += after
    assert floors.offered(Kind.CORE, 30, 10, node=True) == node
    assert floors.offered(Kind.CORE, 30, 10) == lists
    assert floors.offered(Kind.CORE, 95, 10) == 95  # never less than the ledger's offer
    assert floors.offered(Kind.MEMORY, 7, 0) == 7


EXPIRE = [  # (seconds after the fall, whether expire() reports an end, floor left)
    pytest.param(1.0, False, True, id="within: nothing ends"),
    pytest.param(2.0, True, True, id="the Node's moment ends"),
    pytest.param(4.0, True, False, id="the lists' moment ends: gone"),
]


@pytest.mark.parametrize(("after", "ended", "left"), EXPIRE)
def test_expire(after: float, ended: bool, left: bool) -> None:
    floors, clock = floors_after(100)
    floors.note(Kind.CORE, 10, 30, settle=True, drop=False, now=clock())
    clock.now += after
    assert floors.expire() is ended
    assert (Kind.CORE in floors.floors) is left
    assert not floors.expire()  # each end is reported once


@pytest.mark.parametrize(
    ("after", "remaining", "expected"),
    [
        pytest.param(0.0, 10.0, 2.0, id="until the Node's moment ends"),
        pytest.param(0.0, 1.0, 1.0, id="a shorter wait stays"),
        pytest.param(2.5, 10.0, 1.5, id="then until the lists' moment ends"),
        pytest.param(5.0, 10.0, 0.001, id="overdue: at once"),
    ],
)
def test_next_end(after: float, remaining: float, expected: float) -> None:
    floors, clock = floors_after(100)
    floors.note(Kind.CORE, 10, 30, settle=True, drop=False, now=clock())
    clock.now += after
    if after >= S:
        floors.floors[Kind.CORE].node_ended = True
    assert floors.next_end(remaining) == pytest.approx(expected)
