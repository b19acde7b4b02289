"""When the usage controller passes over a namespace again (quota.pacing): timers and throttle."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from quota.demand import Demand
from quota.ledger import Ledger
from quota.model import GPUQuota
from quota.pacing import Pacing
from testkit.quota_pods import counted_quota

T0 = datetime(2026, 1, 1, tzinfo=UTC)
GRACE = timedelta(seconds=10)
MARGIN = timedelta(milliseconds=10)


class Clocks:
    """A wall clock and a monotonic one that tests move by hand."""

    def __init__(self) -> None:
        self.wall = T0
        self.mono = 100.0

    def pacing(self, min_interval_s: float = 1.0) -> Pacing:
        return Pacing(
            grace=GRACE,
            min_interval_s=min_interval_s,
            clock=lambda: self.wall,
            monotonic=lambda: self.mono,
        )


def _ledger(admitted: list[timedelta], pending_limit: int = 8) -> Ledger:
    ledger = Ledger.of(GPUQuota(counted_quota(gpu=8)), pending_limit=pending_limit)
    for index, offset in enumerate(admitted):
        assert ledger.admit(f"u{index}", f"p{index}", Demand(10, 64), T0 + offset) is None
    return ledger


@pytest.mark.parametrize(
    ("last_s_ago", "urgent", "passes", "due_in_s"),
    [
        pytest.param(None, False, True, None, id="never-passed"),
        pytest.param(5.0, False, True, None, id="interval-elapsed"),
        pytest.param(0.25, False, False, 0.75, id="too-soon-falls-due-when-it-may"),
        pytest.param(0.25, True, True, None, id="too-soon-but-urgent"),
    ],
)
def test_may_pass_throttles_to_one_pass_per_interval_unless_urgent(
    last_s_ago: float | None, urgent: bool, passes: bool, due_in_s: float | None
) -> None:
    clocks = Clocks()
    pacing = clocks.pacing(min_interval_s=1.0)
    if last_s_ago is not None:
        pacing.last["ns"] = clocks.mono - last_s_ago
    assert pacing.may_pass("ns", urgent=urgent) is passes
    expected = None if due_in_s is None else T0 + timedelta(seconds=due_in_s)
    assert pacing.due.get("ns") == expected
    assert (pacing.last["ns"] == clocks.mono) is passes


def test_a_throttled_namespace_keeps_an_earlier_due_time() -> None:
    clocks = Clocks()
    pacing = clocks.pacing(min_interval_s=1.0)
    pacing.last["ns"] = clocks.mono
    pacing.due["ns"] = T0 + timedelta(seconds=0.1)
    assert not pacing.may_pass("ns", urgent=False)
    assert pacing.due["ns"] == T0 + timedelta(seconds=0.1)


@pytest.mark.parametrize(
    ("admitted", "pending_limit", "current", "due"),
    [
        pytest.param([], 8, None, None, id="nothing-pending-nothing-due"),
        pytest.param([timedelta(0)], 8, None, T0 + GRACE + MARGIN, id="one-admission"),
        pytest.param(
            [timedelta(seconds=3), timedelta(seconds=1)],
            8,
            None,
            T0 + timedelta(seconds=1) + GRACE + MARGIN,
            id="the-oldest-admission",
        ),
        pytest.param(
            [timedelta(seconds=2), timedelta(seconds=5)],
            1,
            None,
            T0 + timedelta(seconds=2) + GRACE + MARGIN,
            id="the-unmatched-aggregate-counts",
        ),
        pytest.param([timedelta(0)], 8, T0, T0, id="an-earlier-due-time-is-kept"),
        pytest.param(
            [timedelta(0)],
            8,
            T0 + timedelta(hours=1),
            T0 + GRACE + MARGIN,
            id="a-later-due-time-is-brought-forward",
        ),
    ],
)
def test_schedule_makes_a_namespace_due_when_its_oldest_admission_passes_the_grace(
    admitted: list[timedelta], pending_limit: int, current: datetime | None, due: datetime | None
) -> None:
    pacing = Clocks().pacing()
    if current is not None:
        pacing.due["ns"] = current
    pacing.schedule("ns", _ledger(admitted, pending_limit))
    assert pacing.due.get("ns") == due


@pytest.mark.parametrize(
    ("due", "left", "wait", "fallen"),
    [
        pytest.param({}, 30.0, 30.0, [], id="nothing-due-waits-until-resync"),
        pytest.param({"a": T0 + timedelta(seconds=2)}, 30.0, 2.0, [], id="waits-until-due"),
        pytest.param({"a": T0 + timedelta(seconds=2)}, 1.0, 1.0, [], id="resync-comes-first"),
        pytest.param(
            {"a": T0 - timedelta(seconds=1), "b": T0, "c": T0 + timedelta(seconds=1)},
            30.0,
            0.0,
            ["a", "b"],
            id="overdue-does-not-wait",
        ),
    ],
)
def test_wait_and_fallen_due(
    due: dict[str, datetime], left: float, wait: float, fallen: list[str]
) -> None:
    pacing = Clocks().pacing()
    pacing.due.update(due)
    assert pacing.wait_s(left) == wait
    assert sorted(pacing.fallen_due()) == fallen


@pytest.mark.parametrize(
    ("namespace", "left"),
    [pytest.param("a", ["b"], id="one-namespace"), pytest.param(None, [], id="every-namespace")],
)
def test_a_pass_clears_what_was_due(namespace: str | None, left: list[str]) -> None:
    pacing = Clocks().pacing()
    pacing.due.update({"a": T0, "b": T0})
    pacing.passing(namespace)
    assert sorted(pacing.due) == left
