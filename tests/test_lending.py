"""The lending policy (deviceplugin/shared/lending.py), case by case: named tables of shares on
one card and the ceilings they get."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from core.policy import Priority
from deviceplugin.shared.lending import ShareState, ceilings, wants_more

H, L = Priority.HIGH, Priority.LOW


def share(
    key: str, guarantee: int, used: float, *, prio: Priority = L, burst: bool = True
) -> ShareState:
    # Wants more when it ran at its guarantee (its ceiling when nothing is lent).
    return ShareState(key, guarantee, prio, burst, used, wants_more(used, guarantee, guarantee))


@dataclass(frozen=True)
class Case:
    name: str
    shares: tuple[ShareState, ...]
    expected: dict[str, int]


CASES = [
    Case(
        "nothing to lend: both busy", (share("a", 30, 30), share("b", 70, 70)), {"a": 30, "b": 70}
    ),
    Case("a lone busy share takes the idle card", (share("a", 30, 30),), {"a": 100}),
    Case(
        "an idle owner's guarantee is lent",
        (share("a", 30, 30), share("b", 70, 0)),
        {"a": 100, "b": 70},
    ),
    Case(
        "the owner back: its guarantee at once",
        (share("a", 30, 99), share("b", 70, 5)),
        {"a": 30, "b": 70},
    ),
    Case(
        "a share that may not burst keeps its guarantee",
        (share("a", 30, 30, burst=False), share("b", 20, 0)),
        {"a": 30, "b": 20},
    ),
    Case(
        "a share below its ceiling wants nothing",
        (share("a", 30, 10), share("b", 20, 0)),
        {"a": 30, "b": 20},
    ),
    Case(
        "split in proportion to guarantees",
        (share("a", 10, 10), share("b", 30, 30), share("c", 40, 0)),
        {"a": 25, "b": 75, "c": 40},
    ),
    Case(
        "high priority first",
        (share("hi", 40, 40, prio=H), share("lo", 20, 20), share("idle", 20, 0)),
        {"hi": 80, "lo": 20, "idle": 20},
    ),
    Case(
        "low priority gets what high cannot hold",
        (share("hi", 90, 90, prio=H), share("lo", 5, 5)),
        {"hi": 95, "lo": 5},
    ),
    Case(
        "a capped borrower leaves the rest to the others",
        (share("a", 90, 90), share("b", 1, 1)),
        {"a": 99, "b": 1},
    ),
    Case(
        "an active high share that wants nothing lends nothing of its own",
        (share("hi", 50, 40, prio=H), share("lo", 20, 20)),
        {"hi": 50, "lo": 50},
    ),
    Case(
        "rounding leftovers are placed, never more than lendable",
        (share("a", 1, 1), share("b", 1, 1), share("c", 1, 1)),
        {"a": 34, "b": 33, "c": 33},
    ),
    Case("no shares", (), {}),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_ceilings(case: Case) -> None:
    got = ceilings(case.shares)
    assert got == case.expected
    for s in case.shares:
        assert s.guarantee <= got[s.key] <= 100
    active = [s for s in case.shares if s.used >= 1]
    assert sum(got[s.key] for s in active) <= max(100, sum(s.guarantee for s in active))


WANTS = {
    "held back at its guarantee": (25, 30, 30, True),
    "below its guarantee": (24, 30, 30, False),
    "a whole-card guarantee at it": (96, 100, 100, True),
    "on a loan, using it": (94, 100, 30, True),
    "on a loan, using it partly": (60, 100, 30, True),
    "on a loan, back to its guarantee": (35, 100, 30, False),
}


@pytest.mark.parametrize(
    ("used", "ceiling", "guarantee", "expected"), list(WANTS.values()), ids=list(WANTS)
)
def test_wants_more(used: float, ceiling: int, guarantee: int, expected: bool) -> None:
    assert wants_more(used, ceiling, guarantee) is expected


@pytest.mark.parametrize(
    ("guarantee", "used"), [(0, 1), (101, 1), (30, -1), (30, 101)], ids=["g0", "g101", "u-", "u+"]
)
def test_out_of_range_is_refused(guarantee: int, used: float) -> None:
    with pytest.raises(ValueError):
        ShareState("a", guarantee, L, True, used, False)


def test_keys_must_be_distinct() -> None:
    with pytest.raises(ValueError):
        ceilings([share("a", 10, 0), share("a", 20, 0)])


def test_a_share_bursts_only_to_its_own_limit_and_the_rest_goes_to_the_others() -> None:
    capped = ShareState("a", 30, L, True, 30, True, cap=60)
    other = ShareState("b", 20, L, True, 20, True)
    assert ceilings([capped, other]) == {"a": 60, "b": 40}


def test_a_cap_below_the_guarantee_is_refused() -> None:
    with pytest.raises(ValueError):
        ShareState("a", 30, L, True, 30, True, cap=20)
