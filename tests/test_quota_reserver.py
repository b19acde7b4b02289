"""The reservation engine on the in-memory store: batches, CAS retries, partial failure."""

import asyncio
import random
from typing import Any

from quota.demand import Demand
from quota.ledger import Ledger
from quota.model import GPUQuota
from quota.reserver import Reserver
from quota.store import Conflict, MemoryStore, Unavailable
from testkit.quota_pods import counted_quota as gpu_quota


class InterleavingStore(MemoryStore):
    """The in-memory store with a scheduling point inside every call, so that concurrent
    reservers really interleave between their read and their write (as over HTTP)."""

    def __init__(self, *args: Any, seed: int = 1) -> None:
        super().__init__(*args)
        self.random = random.Random(seed)
        self.conflicts = 0

    async def _pause(self) -> None:
        for _ in range(self.random.randint(0, 3)):
            await asyncio.sleep(0)

    async def list(self, namespace: str | None) -> list[dict[str, Any]]:
        await self._pause()
        return await super().list(namespace)

    async def get(self, namespace: str, name: str) -> dict[str, Any]:
        await self._pause()
        return await super().get(namespace, name)

    async def write_status(self, obj: dict[str, Any]) -> dict[str, Any]:
        await self._pause()
        try:
            return await super().write_status(obj)
        except Conflict:
            self.conflicts += 1
            raise


async def _ledger(store: MemoryStore, name: str = "team-a") -> Ledger:
    return Ledger.of(GPUQuota(await store.get("team-a", name)))


async def test_concurrent_replicas_never_over_admit() -> None:
    store = InterleavingStore([gpu_quota(gpu="4.5", gpumem="64Gi")])
    replicas = [
        Reserver(store, max_attempts=50, pending_limit=8),
        Reserver(store, max_attempts=50, pending_limit=8),
    ]
    asks = [Demand(30, 4096) for _ in range(200)]
    decisions = await asyncio.gather(
        *(replicas[i % 2].decide("team-a", f"u{i}", f"p{i}", d) for i, d in enumerate(asks))
    )
    allowed = [i for i, d in enumerate(decisions) if d.allowed]
    # 15 pods fit the cards (15 x 0.30 = 4.5); memory allows 16.
    assert len(allowed) == 15
    ledger = await _ledger(store)
    # Bounded: the 8 most recent admissions one by one, the 7 before them in one aggregate.
    assert len(ledger.pending) == 8
    assert ledger.unmatched.total.pods == 7
    assert {entry.uid for entry in ledger.pending} <= {f"u{i}" for i in allowed}
    assert ledger.charged(None).core == 450
    assert store.conflicts > 0  # the replicas did race
    denied = [d for d in decisions if not d.allowed]
    assert all(d.reason == "exceeded" for d in denied)


async def test_all_quotas_must_pass_and_partial_reservations_are_released() -> None:
    store = MemoryStore([gpu_quota("a-cards", gpu=4), gpu_quota("b-pods", pods=1)])
    reserver = Reserver(store)
    first = await reserver.decide("team-a", "u1", "p1", Demand(50, 256))
    second = await reserver.decide("team-a", "u2", "p2", Demand(50, 256))
    assert first.allowed
    assert not second.allowed
    assert 'quota "b-pods" allows 1 GPU pod (1 used)' in second.message
    # u2 fitted "a-cards" (checked first) and was released when "b-pods" denied it.
    assert [entry.uid for entry in (await _ledger(store, "a-cards")).pending] == ["u1"]
    assert (await _ledger(store, "a-cards")).charged(None).core == 50


async def test_dry_run_reserves_nothing() -> None:
    store = MemoryStore([gpu_quota(gpu=1)])
    reserver = Reserver(store)
    assert (await reserver.decide("team-a", "u1", "p", Demand(100, 256), dry_run=True)).allowed
    assert (await _ledger(store)).pending == []
    denied = await reserver.decide("team-a", "u2", "p", Demand(200, 256), dry_run=True)
    assert not denied.allowed
    assert denied.message.startswith('GPU quota exceeded in namespace "team-a"')


async def test_namespace_without_quota() -> None:
    store = MemoryStore([gpu_quota(gpu=1)])
    assert (await Reserver(store).decide("other", "u", "p", Demand(800, 256))).allowed
    strict = await Reserver(store, require_quota=True).decide("other", "u", "p", Demand(10, 256))
    assert not strict.allowed
    assert strict.message.startswith('GPU quota required in namespace "other"')


async def test_store_down_denies_as_unverifiable() -> None:
    class Down(MemoryStore):
        async def list(self, namespace: str | None) -> list[dict[str, Any]]:
            raise Unavailable("the Kubernetes API server refused the connection")

    decision = await Reserver(Down()).decide("team-a", "u", "p", Demand(10, 256))
    assert not decision.allowed
    assert decision.reason == "unverifiable"
    assert "refused the connection" in decision.message


async def test_slow_store_times_out() -> None:
    class Slow(MemoryStore):
        async def list(self, namespace: str | None) -> list[dict[str, Any]]:
            await asyncio.sleep(10)
            return []

    reserver = Reserver(Slow(), timeout_s=0.05)
    decision = await reserver.decide("team-a", "u", "p", Demand(10, 256))
    assert not decision.allowed
    assert "did not answer within 0.05s" in decision.message
    await reserver.close()


async def test_persistent_conflicts_are_bounded() -> None:
    class AlwaysConflict(MemoryStore):
        async def write_status(self, obj: dict[str, Any]) -> dict[str, Any]:
            raise Conflict("changed")

    reserver = Reserver(AlwaysConflict([gpu_quota(gpu=1)]), max_attempts=3)
    decision = await reserver.decide("team-a", "u", "p", Demand(10, 256))
    assert not decision.allowed
    assert "changed 3 times" in decision.message
    assert reserver.metrics.conflicts.labels("admission")._value.get() == 3
