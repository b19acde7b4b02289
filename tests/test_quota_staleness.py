"""Admission noticing that the usage controller is behind (quota.staleness)."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from prometheus_client import CollectorRegistry

from quota import messages
from quota.demand import Demand
from quota.ledger import Ledger
from quota.metrics import QuotaMetrics
from quota.model import CONTROLLER_ACTIVE, GPUQuota, now
from quota.staleness import Staleness
from testkit.quota_pods import counted_quota

STALE_AFTER_S = 60.0
ASK = Demand(10, 64)


def _quota(ages_s: list[float], pending_limit: int = 8) -> GPUQuota:
    """A quota holding one admission per age (in seconds), oldest first."""
    quota = GPUQuota(counted_quota(gpu=8))
    ledger = Ledger.of(quota, pending_limit=pending_limit)
    at = now()
    for index, age in enumerate(sorted(ages_s, reverse=True)):
        assert ledger.admit(f"u{index}", f"p{index}", ASK, at - timedelta(seconds=age)) is None
    return quota.with_status(ledger.status(quota.status))


def _staleness(controller: bool = True) -> Staleness:
    return Staleness(
        QuotaMetrics(CollectorRegistry()), controller=controller, stale_after_s=STALE_AFTER_S
    )


@pytest.mark.parametrize(
    ("controller", "ages_s", "pending_limit", "stale_age_s"),
    [
        pytest.param(True, [], 8, None, id="nothing-unmatched"),
        pytest.param(True, [5.0], 8, None, id="recent-admission"),
        pytest.param(True, [90.0, 5.0], 8, 90.0, id="old-pending-admission"),
        pytest.param(True, [90.0, 5.0], 1, 90.0, id="old-unmatched-aggregate"),
        pytest.param(False, [90.0], 8, None, id="embedded-never-matches"),
    ],
)
def test_unmatched_since_is_the_oldest_admission_once_stale(
    controller: bool, ages_s: list[float], pending_limit: int, stale_age_s: float | None
) -> None:
    since = _staleness(controller).unmatched_since(_quota(ages_s, pending_limit))
    if stale_age_s is None:
        assert since is None
    else:
        assert since is not None
        assert abs((now() - since).total_seconds() - stale_age_s) < 5


@pytest.mark.parametrize(
    ("ages_s", "behind"),
    [
        pytest.param([5.0], False, id="controller-keeping-up"),
        pytest.param([90.0], True, id="behind"),
    ],
)
def test_a_denial_says_when_the_controller_is_behind(ages_s: list[float], behind: bool) -> None:
    quota = _quota(ages_s)
    violation = Ledger.of(quota).check(Demand(5000, 64))
    assert violation is not None
    message = _staleness().exceeded(quota, violation)
    assert message.startswith(messages.exceeded(violation))
    assert ("; " in message[len(messages.exceeded(violation)) :]) is behind


def test_flag_marks_the_quota_and_logs_once_until_the_controller_catches_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "quota.staleness")
    staleness = _staleness()
    stale, fresh = _quota([90.0]), _quota([5.0])
    age = staleness.metrics.unmatched_age.labels("team-a", "team-a")
    for quota, flagged, logs in [
        (stale, True, 1),
        (stale, True, 1),  # logged once
        (fresh, False, 1),  # caught up: no condition, the metric back to 0
        (stale, True, 2),  # behind again: logged again
    ]:
        status = staleness.flag(quota, quota.status)
        condition = status.condition(CONTROLLER_ACTIVE)
        assert (condition is not None and condition.reason == "AdmissionsUnmatched") is flagged
        assert (age._value.get() > STALE_AFTER_S) is flagged
        assert len(caplog.records) == logs
