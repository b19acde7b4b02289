"""Writing a recounted status (quota.countwriter): compare-and-swap, retries, first counts."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from quota.countwriter import CountWriter, readable
from quota.livepods import LivePods
from quota.metrics import QuotaMetrics
from quota.model import GPUQuota, now
from quota.pacing import Pacing
from quota.recount import Recounter
from quota.store import Conflict, MemoryStore
from testkit.quota_pods import counted_quota, gpu_pod, gpu_quota


class NoLive(LivePods):
    """Live reads of a namespace whose pods are ``pods``."""

    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.pods = pods

    async def read(self, namespace: str) -> list[dict[str, Any]]:
        return self.pods

    async def exists(self, namespace: str, name: str, uid: str) -> bool:
        return False


class ConflictingStore(MemoryStore):
    """Refuses the first ``conflicts`` status writes, as if another writer had won each time."""

    def __init__(self, objects: list[dict[str, Any]], conflicts: int) -> None:
        super().__init__(objects)
        self.conflicts = conflicts
        self.writes = 0

    async def write_status(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.writes += 1
        if self.conflicts:
            self.conflicts -= 1
            raise Conflict("changed")
        return await super().write_status(obj)


def _writer(store: MemoryStore, max_attempts: int = 20) -> CountWriter:
    pods = [gpu_pod("p", 40, 4, uid="u1")]
    metrics = QuotaMetrics(CollectorRegistry())
    grace = timedelta(seconds=10)
    recounter = Recounter(
        lambda namespace: pods,
        NoLive(pods),
        Pacing(grace=grace, min_interval_s=1.0, clock=now),
        metrics,
        demands={},
        deleted=set(),
        grace=grace,
    )
    return CountWriter(store, recounter, metrics, max_attempts=max_attempts)


def _with_uid(raw: dict[str, Any]) -> dict[str, Any]:
    raw["metadata"]["uid"] = "q1"
    return raw


def _bad_status() -> dict[str, Any]:
    raw = counted_quota(gpu=1)
    raw["status"]["used"] = "garbage"
    return raw


@pytest.mark.parametrize(
    ("raw", "result", "log"),
    [
        pytest.param(counted_quota(gpu=1), "as-is", None, id="readable"),
        pytest.param(_bad_status(), "empty-status", "status unreadable", id="status-rebuilt"),
        pytest.param(gpu_quota(), None, "invalid GPUQuota skipped", id="spec-invalid-skipped"),
    ],
)
def test_readable(
    caplog: pytest.LogCaptureFixture, raw: dict[str, Any], result: str | None, log: str | None
) -> None:
    caplog.set_level(logging.WARNING, "quota.countwriter")
    quota = readable(raw)
    if result is None:
        assert quota is None
    else:
        assert quota is not None
        assert quota.raw.get("status") == (raw["status"] if result == "as-is" else {})
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ([] if log is None else [m for m in messages if log in m])
    assert len(messages) == (log is not None)


@pytest.mark.parametrize(
    ("conflicts", "max_attempts", "used", "lost"),
    [
        pytest.param(0, 20, 40, 0, id="written-at-once"),
        pytest.param(2, 20, 40, 2, id="written-after-two-conflicts"),
        pytest.param(8, 2, None, 8, id="gives-up-after-four-times-max-attempts"),
    ],
)
async def test_reconcile_writes_with_compare_and_swap(
    caplog: pytest.LogCaptureFixture,
    conflicts: int,
    max_attempts: int,
    used: int | None,
    lost: int,
) -> None:
    store = ConflictingStore([_with_uid(counted_quota(gpu=4))], conflicts)
    writer = _writer(store, max_attempts)
    await writer.reconcile(await store.get("team-a", "team-a"))
    status = (await store.get("team-a", "team-a"))["status"]
    assert status.get("used", {}).get("core") == used
    assert writer.metrics.conflicts.labels("controller")._value.get() == lost
    assert ("q1" in writer.recounter.accounted) is (used is not None)
    gave_up = [r for r in caplog.records if "kept changing" in r.getMessage()]
    assert len(gave_up) == (used is None)


@pytest.mark.parametrize(
    ("raw", "conflicts", "counted", "counted_here", "lost"),
    [
        pytest.param(gpu_quota(gpu=4), 0, True, 1, 0, id="counts-a-new-quota"),
        pytest.param(counted_quota(gpu=4), 0, True, 0, 0, id="leaves-a-counted-quota-alone"),
        pytest.param(gpu_quota(gpu=4), 3, False, 0, 3, id="tries-three-times-only"),
    ],
)
async def test_count_counts_a_quota_nobody_has_counted(
    raw: dict[str, Any], conflicts: int, counted: bool, counted_here: int, lost: int
) -> None:
    store = ConflictingStore([_with_uid(raw)], conflicts)
    writer = _writer(store)
    await writer.count(await store.get("team-a", "team-a"))
    assert writer.metrics.first_counts._value.get() == counted_here
    assert writer.metrics.conflicts.labels("count")._value.get() == lost
    stored = GPUQuota(await store.get("team-a", "team-a"))
    assert stored.counted() is counted
    assert stored.status.condition("ControllerActive") is None
