"""The usage controller: ``status.used`` recounted from the pods that exist, namespace by namespace.

It watches pods and GPUQuotas once (shared informers) and passes over every quota at each
periodic resync, and in between over the namespaces that changed or whose admissions fall due,
in small debounced batches. Its parts, one concept each:

* :mod:`quota.intake`: what the watches report between passes (dirty namespaces, pod demands,
  pods seen deleted);
* :mod:`quota.pacing`: when a namespace is passed over again (admissions falling due, at most
  one pass per ``min_interval_s`` unless a quota waits to be counted);
* :mod:`quota.recount`: one quota's status computed again from the pods (what ``used`` is the
  sum of, and when an admission is released);
* :mod:`quota.countwriter`: that status written with compare-and-swap, retried on 409;
* :mod:`quota.livepods`: the pods read live where the cache may lag.

A pod is therefore charged at least once from its admission until it ends: usage may be
over-counted for a moment, never under. docs/quota.md gives the whole argument, including the
grace it relies on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any

from prometheus_client import CollectorRegistry

from core.informer import Informers, InformerSettings
from core.kube import GPUQUOTAS, PODS, Api
from quota.claims import ClaimSpecs
from quota.countwriter import CountWriter
from quota.demand import CardMemory
from quota.intake import EventIntake
from quota.ledger import DEFAULT_PENDING_LIMIT
from quota.livepods import LivePods
from quota.metrics import QuotaMetrics
from quota.model import now
from quota.pacing import Pacing
from quota.recount import Recounter
from quota.store import NotFound, QuotaStore, Unavailable

log = logging.getLogger(__name__)


class UsageController:
    def __init__(
        self,
        api: Api,
        store: QuotaStore,
        *,
        metrics: QuotaMetrics | None = None,
        resync_s: float = 30.0,
        debounce_s: float = 0.1,
        min_interval_s: float = 1.0,
        max_attempts: int = 20,
        request_timeout_s: float = 2.0,
        grace_s: float = 10.0,
        pending_limit: int = DEFAULT_PENDING_LIMIT,
        clock: Callable[[], datetime] = now,
        card_memory: CardMemory | None = None,
        claims: ClaimSpecs | None = None,
        informers: Informers | None = None,
    ) -> None:
        """``informers``: the process's shared ones (its pods and GPUQuotas are then watched
        once for every component that needs them); without, the controller makes its own."""
        self.api = api
        self.store = store
        self.metrics = metrics or QuotaMetrics(CollectorRegistry())
        self.resync_s = resync_s
        self.debounce_s = debounce_s
        self.clock = clock
        settings = InformerSettings(request_timeout_s=request_timeout_s)
        informers = informers or Informers(api, settings=settings)
        self.pods = informers.of(PODS)
        self.quotas = informers.of(GPUQUOTAS)
        grace = timedelta(seconds=grace_s)
        self.intake = EventIntake(self._forget_quota, card_memory=card_memory, claims=claims)
        self.pacing = Pacing(grace=grace, min_interval_s=min_interval_s, clock=clock)
        self.recounter = Recounter(
            self.pods.objects,
            LivePods(api, request_timeout_s=request_timeout_s),
            self.pacing,
            self.metrics,
            demands=self.intake.demands,
            deleted=self.intake.deleted,
            grace=grace,
            pending_limit=pending_limit,
            clock=clock,
            card_memory=card_memory,
            claims=claims,
        )
        self.writer = CountWriter(store, self.recounter, self.metrics, max_attempts=max_attempts)

    def _forget_quota(self, namespace: str, name: str, uid: str) -> None:
        self.recounter.forget(uid)
        self.metrics.forget(namespace, name)

    async def run(self) -> None:
        """Watch pods and GPUQuotas and reconcile until cancelled."""
        self.pods.add_handler(self.intake.on_pod)
        self.quotas.add_handler(self.intake.on_quota)
        self.pods.start()
        self.quotas.start()
        try:
            await self.pods.wait_synced()
            await self.quotas.wait_synced()
            while True:
                await self.reconcile_all()
                await self._until_resync()
        finally:
            self.pods.remove_handler(self.intake.on_pod)
            self.quotas.remove_handler(self.intake.on_quota)
            await self.pods.stop()
            await self.quotas.stop()

    async def _until_resync(self) -> None:
        """Reconcile namespaces whose pods or quotas changed, or whose admissions fall due,
        in small batches, until the periodic full pass is due."""
        intake, pacing = self.intake, self.pacing
        deadline = time.monotonic() + self.resync_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(intake.wake.wait(), pacing.wait_s(left))
            except TimeoutError:
                intake.dirty.update(pacing.fallen_due())
                if not intake.dirty:
                    continue
            await asyncio.sleep(self.debounce_s)
            dirty, urgent = intake.take()
            for namespace in sorted(dirty):
                # A quota admission waits for goes at once; the others wait their turn.
                if pacing.may_pass(namespace, urgent=namespace in urgent):
                    await self._guarded(namespace)

    async def _guarded(self, namespace: str | None) -> None:
        try:
            self.pacing.passing(namespace)
            for raw in await self._list(namespace):
                await self.reconcile(raw)
            self.metrics.reconciles.labels("ok").inc()
        except (Unavailable, NotFound) as exc:
            self.metrics.reconciles.labels("error").inc()
            log.warning(
                "quota reconcile failed; retried at the next pass",
                extra={"namespace": namespace, "error": str(exc)},
            )

    async def _list(self, namespace: str | None) -> list[dict[str, Any]]:
        """From the GPUQuota cache once synced (a stale object only costs a 409 and a re-read),
        else live."""
        if self.quotas.has_synced:
            return [dict(raw) for raw in self.quotas.objects(namespace)]
        return await self.store.list(namespace)

    async def reconcile_all(self) -> None:
        await self._guarded(None)

    async def reconcile(self, raw: Mapping[str, Any]) -> None:
        """Recount one GPUQuota and drop the admissions it no longer needs to hold."""
        await self.writer.reconcile(raw)

    async def count(self, raw: Mapping[str, Any]) -> None:
        """Count one GPUQuota nobody has counted yet (:meth:`quota.countwriter.CountWriter.count`).
        Raises :class:`quota.store.Unavailable` when the API server cannot be reached."""
        await self.writer.count(raw)
