"""Which GPUQuotas of a namespace a decision uses (quota.usable), on the in-memory store."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import pytest

from quota.decision import Decision
from quota.model import GPUQuota
from quota.store import MemoryStore, NotFound, Unavailable
from quota.usable import QuotaCounter, UsableQuotas
from testkit.quota_pods import counted_quota, gpu_quota


class NoCrd(MemoryStore):
    async def list(self, namespace: str | None) -> list[dict[str, Any]]:
        raise NotFound("the server could not find the requested resource")


class GoneOnGet(MemoryStore):
    """Lists a quota that is deleted before it can be read again."""

    async def get(self, namespace: str, name: str) -> dict[str, Any]:
        raise NotFound(f"GPUQuota {namespace}/{name} not found")


def _counts(store: MemoryStore) -> QuotaCounter:
    async def count(raw: Mapping[str, Any]) -> None:
        store.put(counted_quota(raw["metadata"]["name"], gpu=1))

    return count


async def _cannot(raw: Mapping[str, Any]) -> None:
    raise Unavailable("the API server is down")


def _names(result: list[GPUQuota] | Decision) -> list[str]:
    assert isinstance(result, list), result
    return [quota.name for quota in result]


@pytest.mark.parametrize(
    ("store", "require_quota", "decision"),
    [
        pytest.param(NoCrd(), False, Decision(False, reason="no-crd"), id="crd-missing"),
        pytest.param(MemoryStore(), False, Decision(True, reason="no-quota"), id="none-allows"),
        pytest.param(
            MemoryStore(), True, Decision(False, reason="no-quota"), id="none-but-required"
        ),
    ],
)
async def test_a_namespace_without_usable_quotas_is_decided_as_a_whole(
    store: MemoryStore, require_quota: bool, decision: Decision
) -> None:
    usable = UsableQuotas(store, require_quota=require_quota)
    assert await usable.of("team-a") == decision


async def test_an_unreadable_quota_denies_naming_it() -> None:
    usable = UsableQuotas(MemoryStore([counted_quota(gpu=1), gpu_quota("bad")]))
    decision = await usable.of("team-a")
    assert isinstance(decision, Decision)
    assert decision.reason == "invalid-quota"
    assert '"team-a/bad"' in decision.message


@pytest.mark.parametrize(
    ("controller", "counter", "names", "reason"),
    [
        pytest.param(True, None, None, "not-counted", id="never-counted-is-denied"),
        pytest.param(True, "counts", ["a", "b"], None, id="counted-here-after-handover"),
        pytest.param(True, "cannot", None, "not-counted", id="count-failing-is-denied"),
        pytest.param(False, None, ["a", "b"], None, id="embedded-uses-it-as-it-is"),
    ],
)
async def test_an_uncounted_quota_waits_for_its_count(
    caplog: pytest.LogCaptureFixture,
    controller: bool,
    counter: str | None,
    names: list[str] | None,
    reason: str | None,
) -> None:
    caplog.set_level(logging.WARNING, "quota.usable")
    store = MemoryStore([counted_quota("a", gpu=1), gpu_quota("b", gpu=1)])
    counters = {"counts": _counts(store), "cannot": _cannot, None: None}
    usable = UsableQuotas(
        store, controller=controller, count_wait_s=0.2, counter=counters[counter], handover_s=0.05
    )
    result = await usable.of("team-a")
    if names is not None:
        assert _names(result) == names
    else:
        assert isinstance(result, Decision)
        assert result.reason == reason
    assert any("could not count" in r.getMessage() for r in caplog.records) is (counter == "cannot")


async def test_a_quota_deleted_while_waiting_is_not_waited_for() -> None:
    """It stays listed as it was read: reserving in it then finds it gone, and it limits
    nothing (quota.reservation)."""
    usable = UsableQuotas(GoneOnGet([counted_quota("a", gpu=1), gpu_quota("b", gpu=1)]))
    result = await usable.of("team-a")
    assert _names(result) == ["a", "b"]
    assert isinstance(result, list)
    assert not result[1].counted()


@pytest.mark.parametrize(
    ("count_wait_s", "handover_s", "expected"),
    [
        pytest.param(2.0, 0.3, 0.3, id="as-set"),
        pytest.param(0.4, 0.3, 0.2, id="at-most-half-the-wait"),
    ],
)
def test_handover_comes_within_the_first_half_of_the_wait(
    count_wait_s: float, handover_s: float, expected: float
) -> None:
    usable = UsableQuotas(MemoryStore(), count_wait_s=count_wait_s, handover_s=handover_s)
    assert usable.handover_s == expected
