"""The recount of one GPUQuota (quota.recount): which admissions it releases, and why.

No API server: the pods come from a list standing for the watch cache, and a stub standing for
the live reads, so each case names exactly what the controller sees.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from quota.demand import Demand
from quota.ledger import Ledger
from quota.livepods import LivePods
from quota.metrics import QuotaMetrics
from quota.model import CONTROLLER_ACTIVE, COUNTED, GPUQuota
from quota.pacing import Pacing
from quota.recount import Recounter, counted_status
from testkit.quota_pods import counted_quota, gpu_pod

T0 = datetime(2026, 1, 1, tzinfo=UTC)
GRACE = timedelta(seconds=10)
ASK = Demand(40, 64)


class StubLive(LivePods):
    """Live reads answered from a list; counts the lists it was asked for."""

    def __init__(self, pods: Iterable[dict[str, Any]] = (), existing: Iterable[str] = ()) -> None:
        self.pods = list(pods)
        self.existing = set(existing)
        self.reads = 0

    async def read(self, namespace: str) -> list[dict[str, Any]]:
        self.reads += 1
        return self.pods

    async def exists(self, namespace: str, name: str, uid: str) -> bool:
        return uid in self.existing


class World:
    def __init__(
        self,
        cached: Iterable[dict[str, Any]] = (),
        *,
        live: StubLive | None = None,
        deleted: Iterable[str] = (),
        elapsed: timedelta = timedelta(seconds=1),
    ) -> None:
        self.cached = list(cached)
        self.live = live or StubLive(self.cached)
        self.at = T0 + elapsed
        self.metrics = QuotaMetrics(CollectorRegistry())
        self.pacing = Pacing(grace=GRACE, min_interval_s=1.0, clock=lambda: self.at)
        self.recounter = Recounter(
            lambda namespace: self.cached,
            self.live,
            self.pacing,
            self.metrics,
            demands={},
            deleted=set(deleted),
            grace=GRACE,
            clock=lambda: self.at,
        )

    def released(self, why: str) -> float:
        value: float = self.metrics.released.labels(why)._value.get()
        return value


def _quota(admitted: Iterable[str], pending_limit: int = 8) -> GPUQuota:
    """A counted quota of 4 cards holding one admission per UID (pod ``p-<uid>``), at T0."""
    raw = counted_quota(gpu=4)
    raw["metadata"]["uid"] = "q1"
    quota = GPUQuota(raw)
    ledger = Ledger.of(quota, pending_limit=pending_limit)
    for uid in admitted:
        assert ledger.admit(uid, f"p-{uid}", ASK, T0) is None
    return quota.with_status(ledger.status(quota.status))


def _pod(uid: str, phase: str | None = None) -> dict[str, Any]:
    pod = gpu_pod(f"p-{uid}", 40, 4, uid=uid)
    if phase is not None:
        pod["status"] = {"phase": phase}
    return pod


def _pending(quota: GPUQuota) -> list[str]:
    return [entry.uid for entry in quota.status.pending]


@pytest.mark.parametrize(
    ("world", "why", "kept"),
    [
        pytest.param(World([_pod("u1")]), "confirmed", [], id="pod-seen-confirms"),
        pytest.param(World([_pod("u1", "Succeeded")]), "ended", [], id="pod-finished-ends"),
        pytest.param(World([], deleted=["u1"]), "ended", [], id="pod-seen-deleted-ends"),
        pytest.param(World([]), None, ["u1"], id="young-admission-is-kept"),
        pytest.param(World([], elapsed=GRACE * 2), "expired", [], id="old-and-no-pod-expires"),
        pytest.param(
            World([], live=StubLive(existing=["u1"]), elapsed=GRACE * 2),
            None,
            ["u1"],
            id="old-but-the-pod-exists-live-is-kept",
        ),
    ],
)
async def test_a_pending_admission_is_released_only_when_its_pod_is_accounted_for(
    world: World, why: str | None, kept: list[str]
) -> None:
    candidate, _ = await world.recounter.recount(_quota(["u1"]))
    assert candidate is not None
    assert _pending(candidate) == kept
    for reason in ("confirmed", "ended", "expired"):
        assert world.released(reason) == (1 if reason == why else 0)
    assert ("u1" in world.recounter.expired["q1"]) is (why == "expired")


@pytest.mark.parametrize(
    ("world", "settled", "unmatched_pods", "released", "live_reads"),
    [
        pytest.param(World([_pod("new")]), None, 1, 0, 0, id="before-any-write-kept-whole"),
        pytest.param(World([_pod("new")]), set(), None, 0, 0, id="a-new-pod-is-what-it-stood-for"),
        pytest.param(World([_pod("old")]), {"old"}, 1, 0, 0, id="a-pod-counted-before-is-not"),
        pytest.param(
            World([], live=StubLive([_pod("new")]), elapsed=GRACE * 2),
            set(),
            None,
            1,
            1,
            id="dropped-when-due-from-a-live-list",
        ),
    ],
)
async def test_the_unmatched_aggregate_shrinks_by_the_pods_that_appear(
    world: World,
    settled: set[str] | None,
    unmatched_pods: int | None,
    released: int,
    live_reads: int,
) -> None:
    quota = _quota(["u1", "u2"], pending_limit=1)  # u1 is folded into `unmatched`
    assert quota.status.unmatched is not None
    if settled is not None:
        world.recounter.settled("q1", settled)
    candidate, _ = await world.recounter.recount(quota)
    assert candidate is not None
    unmatched = candidate.status.unmatched
    assert (None if unmatched is None else unmatched.pods) == unmatched_pods
    assert world.released("unmatched") == released
    assert world.live.reads == live_reads


async def test_a_pod_whose_admission_expired_does_not_shrink_unmatched() -> None:
    world = World([_pod("late")])
    world.recounter.settled("q1", set())
    world.recounter.expired["q1"] = {"late"}
    candidate, _ = await world.recounter.recount(_quota(["u1", "u2"], pending_limit=1))
    assert candidate is not None
    assert candidate.status.unmatched is not None
    assert candidate.status.unmatched.pods == 1


@pytest.mark.parametrize(
    ("fresh", "live_reads"),
    [pytest.param(False, 0, id="from-the-cache"), pytest.param(True, 1, id="fresh-reads-live")],
)
async def test_recount_counts_the_live_pods_and_schedules_the_namespace(
    fresh: bool, live_reads: int
) -> None:
    world = World([_pod("u1"), _pod("ended", "Failed")])
    candidate, live = await world.recounter.recount(_quota(["u2"]), fresh=fresh)
    assert candidate is not None
    assert live == {"u1"}
    assert candidate.status.used.core == 80  # u1's pod, u2's admission
    assert candidate.status.last_reconcile_time == world.at
    assert world.live.reads == live_reads
    assert world.pacing.due["team-a"] > world.at


async def test_a_recount_that_changes_nothing_has_nothing_to_write() -> None:
    world = World([_pod("u1")])
    candidate, _ = await world.recounter.recount(_quota([]))
    assert candidate is not None
    again, live = await world.recounter.recount(candidate)
    assert again is None
    assert live == {"u1"}


def test_forget_drops_what_was_remembered_of_a_quota() -> None:
    recounter = World().recounter
    recounter.settled("q1", {"a"})
    recounter.expired["q1"] = {"b"}
    recounter.forget("q1")
    assert recounter.accounted == {}
    assert recounter.expired == {}


@pytest.mark.parametrize(
    ("active", "conditions"),
    [
        pytest.param(True, {COUNTED: "Counted", CONTROLLER_ACTIVE: "Matching"}, id="controller"),
        pytest.param(False, {COUNTED: "Counted"}, id="counted-by-admission"),
    ],
)
def test_counted_status(active: bool, conditions: Mapping[str, str]) -> None:
    raw = counted_quota(gpu=4)
    raw["metadata"]["generation"] = 3
    quota = GPUQuota(raw)
    status = counted_status(quota, Ledger.of(quota), counted=2, pending=1, at=T0, active=active)
    assert {c.type: c.reason for c in status.conditions} == conditions
    counted = status.condition(COUNTED)
    assert counted is not None
    assert counted.message == "2 GPU pods counted, 1 admissions pending"
    assert status.observed_generation == 3
