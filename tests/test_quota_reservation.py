"""Reserving a batch of pods in one GPUQuota (quota.reservation), on the in-memory store."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from quota.demand import Demand
from quota.ledger import Ledger
from quota.metrics import QuotaMetrics
from quota.model import GPUQuota, now
from quota.reservation import Reservations, Waiter
from quota.staleness import Staleness
from quota.store import Conflict, MemoryStore, NotFound, Unavailable
from testkit.quota_pods import counted_quota


class CountingStore(MemoryStore):
    """Counts reads and writes; refuses the first ``conflicts`` writes, or every write with
    NotFound when ``gone``."""

    def __init__(self, objects: list[dict[str, Any]], conflicts: int = 0, gone: bool = False):
        super().__init__(objects)
        self.conflicts = conflicts
        self.gone = gone
        self.gets = 0
        self.writes = 0

    async def get(self, namespace: str, name: str) -> dict[str, Any]:
        self.gets += 1
        return await super().get(namespace, name)

    async def write_status(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.writes += 1
        if self.gone:
            raise NotFound("gone")
        if self.conflicts:
            self.conflicts -= 1
            raise Conflict("changed")
        return await super().write_status(obj)


def _reservations(store: MemoryStore, max_attempts: int = 20) -> Reservations:
    metrics = QuotaMetrics(CollectorRegistry())
    return Reservations(store, metrics, Staleness(metrics), max_attempts=max_attempts)


def _waiter(uid: str, core: int) -> Waiter:
    return Waiter(uid, f"p-{uid}", Demand(core, 64), asyncio.get_running_loop().create_future())


def _holding(uids: list[str], gpu: int = 1) -> dict[str, Any]:
    """A counted quota of ``gpu`` cards already holding 40 hundredths per UID."""
    quota = GPUQuota(counted_quota(gpu=gpu))
    ledger = Ledger.of(quota)
    for uid in uids:
        assert ledger.admit(uid, f"p-{uid}", Demand(40, 64), now()) is None
    return quota.with_status(ledger.status(quota.status)).raw


@dataclass(frozen=True)
class Reserve:
    held: list[str]  # admissions the quota holds already
    asks: list[int]  # one waiter each, "a", "b", ...: hundredths of a card
    accepted: list[str]
    denied: list[str] = field(default_factory=list)
    writes: int = 1
    live_reads: int = 0


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(Reserve([], [40, 40], ["a", "b"]), id="all-fit-one-write"),
        pytest.param(
            Reserve([], [60, 60], ["a"], ["b"], live_reads=1), id="denied-only-on-a-live-read"
        ),
        pytest.param(
            Reserve(["a"], [40], ["a"], writes=0), id="a-repeated-review-is-not-charged-twice"
        ),
        pytest.param(
            Reserve([], [200], [], ["a"], writes=0, live_reads=1), id="none-fits-nothing-written"
        ),
    ],
)
async def test_reserve_admits_what_fits_and_denies_the_rest(case: Reserve) -> None:
    store = CountingStore([_holding(case.held)])
    reservations = _reservations(store)
    quota = GPUQuota(await store.get("team-a", "team-a"))
    store.gets = 0
    waiters = [_waiter(uid, core) for uid, core in zip("abc", case.asks, strict=False)]
    fits = await reservations.reserve("team-a", quota, list(waiters))
    assert [w.uid for w in fits] == case.accepted
    assert [w.uid for w in fits if w.held == ["team-a"]] == case.accepted
    assert [w.uid for w in waiters if w.denied] == case.denied
    for waiter in waiters:
        if waiter.denied:
            assert waiter.future.result().reason == "exceeded"
            assert "GPU quota exceeded" in waiter.future.result().message
    assert store.writes == case.writes
    assert store.gets == case.live_reads
    stored = Ledger.of(GPUQuota(await store.get("team-a", "team-a")))
    expected = sorted(set(case.held) | set(case.accepted))
    assert sorted(entry.uid for entry in stored.pending) == expected


async def test_pods_queued_meanwhile_join_the_retry_after_a_conflict() -> None:
    store = CountingStore([_holding([])], conflicts=1)
    reservations = _reservations(store)
    late = _waiter("late", 40)
    asked: list[int] = []

    def joined() -> list[Waiter]:
        asked.append(1)
        return [late]

    quota = GPUQuota(await store.get("team-a", "team-a"))
    fits = await reservations.reserve("team-a", quota, [_waiter("a", 40)], joined)
    assert [w.uid for w in fits] == ["a", "late"]
    assert asked == [1]
    assert store.writes == 2
    assert reservations.metrics.conflicts.labels("admission")._value.get() == 1


@pytest.mark.parametrize(
    ("store", "outcome"),
    [
        pytest.param(CountingStore([_holding([])], gone=True), "all", id="deleted-limits-nothing"),
        pytest.param(
            CountingStore([_holding([])], conflicts=99), "unavailable", id="conflicts-bounded"
        ),
    ],
)
async def test_reserve_when_the_quota_will_not_take_the_write(
    store: CountingStore, outcome: str
) -> None:
    reservations = _reservations(store, max_attempts=3)
    quota = GPUQuota(await store.get("team-a", "team-a"))
    waiters = [_waiter("a", 40)]
    if outcome == "unavailable":
        with pytest.raises(Unavailable, match="changed 3 times"):
            await reservations.reserve("team-a", quota, waiters)
    else:
        assert await reservations.reserve("team-a", quota, waiters) == waiters


@dataclass(frozen=True)
class Release:
    held_by_waiter: list[str]  # the quotas waiter "a" holds a reservation in
    stored: list[str]  # the admissions quota "team-a" holds
    pending_after: list[str]
    released: int = 0
    warned: bool = False


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(Release(["team-a"], ["a", "b"], ["b"], released=1), id="withdrawn"),
        pytest.param(Release(["team-a"], ["b"], ["b"]), id="already-gone-nothing-written"),
        pytest.param(Release([], ["a"], ["a"]), id="held-nowhere-nothing-to-do"),
        pytest.param(
            Release(["elsewhere"], ["a"], ["a"], warned=True), id="quota-deleted-left-to-expire"
        ),
    ],
)
async def test_release_withdraws_the_admissions_of_denied_pods(
    caplog: pytest.LogCaptureFixture, case: Release
) -> None:
    caplog.set_level(logging.WARNING, "quota.reservation")
    store = CountingStore([_holding(case.stored, gpu=2)])
    reservations = _reservations(store)
    waiter = _waiter("a", 40)
    waiter.held.extend(case.held_by_waiter)
    await reservations.release("team-a", [waiter])
    ledger = Ledger.of(GPUQuota(await store.get("team-a", "team-a")))
    assert [entry.uid for entry in ledger.pending] == case.pending_after
    assert reservations.metrics.released.labels("denied")._value.get() == case.released
    assert any("could not withdraw" in r.getMessage() for r in caplog.records) is case.warned
