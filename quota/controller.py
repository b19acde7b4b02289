"""The usage controller: ``status.used`` recounted from the pods that exist.

Usage is recomputed from the informer's cache, never kept as increments, so a relist (410),
a restart or a missed event heals completely (design K6). For each GPUQuota:

* ``used`` = the demand of every non-terminal pod of the namespace that holds canonical GPU
  resources (terminal as Kubernetes' own quota defines it, :func:`quota.demand.is_terminal`);
* a reservation whose pod is in the cache is released: the pod is counted in ``used`` now
  (confirmed), or it already ended;
* a reservation whose pod is not in the cache and whose expiry has passed is released only
  after a direct GET shows no pod of that name and UID (the cache may lag; a pod that exists
  is never uncounted);
* the write is a compare-and-swap on the version read, so it never erases a reservation
  that admission wrote meanwhile: on 409 the controller re-reads and recomputes.

Until a reservation is released it is charged, so between admission and the controller's
count a pod is charged once or (briefly, if the controller counted it before releasing) never
less than once: usage can be over-counted for a moment, never under-counted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from core.kube import PODS, Api, Informer, KubeError, KubeNotFound, call_json
from quota.demand import Demand, is_terminal, pod_demand
from quota.ledger import Ledger
from quota.metrics import QuotaMetrics
from quota.model import Condition, GPUQuota, QuotaError, now
from quota.store import Conflict, NotFound, QuotaStore, Unavailable

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
        max_attempts: int = 20,
        request_timeout_s: float = 2.0,
        clock: Callable[[], datetime] = now,
    ) -> None:
        self.api = api
        self.store = store
        self.metrics = metrics or QuotaMetrics()
        self.resync_s = resync_s
        self.debounce_s = debounce_s
        self.max_attempts = max_attempts
        self.request_timeout_s = request_timeout_s
        self.clock = clock
        self.pods = Informer(
            api, PODS, handler=self._on_pod, request_timeout_s=request_timeout_s, name="quota-pods"
        )
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()

    def _on_pod(self, _: str, pod: Mapping[str, Any]) -> None:
        namespace = (pod.get("metadata") or {}).get("namespace")
        if namespace and pod_demand(pod) is not None:
            self._dirty.add(str(namespace))
            self._wake.set()

    async def run(self) -> None:
        """Watch pods and reconcile until cancelled."""
        self.pods.start()
        try:
            await self.pods.wait_synced()
            while True:
                await self.reconcile_all()
                try:
                    await asyncio.wait_for(self._wait_dirty(), self.resync_s)
                except TimeoutError:
                    continue  # periodic full pass
        finally:
            await self.pods.stop()

    async def _wait_dirty(self) -> None:
        """Reconcile namespaces whose pods changed, in small batches, until the resync is due."""
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.debounce_s)
            self._wake.clear()
            dirty, self._dirty = self._dirty, set()
            for namespace in sorted(dirty):
                await self._guarded(namespace)

    async def _guarded(self, namespace: str | None) -> None:
        try:
            for raw in await self.store.list(namespace):
                await self.reconcile(raw)
            self.metrics.reconciles.labels("ok").inc()
        except (Unavailable, NotFound) as exc:
            self.metrics.reconciles.labels("error").inc()
            log.warning(
                "quota reconcile failed; retried at the next pass",
                extra={"namespace": namespace, "error": str(exc)},
            )

    async def reconcile_all(self) -> None:
        await self._guarded(None)

    async def reconcile(self, raw: Mapping[str, Any]) -> None:
        """Recount one GPUQuota and release what its reservations no longer need to hold."""
        obj = dict(raw)
        # The controller is off the pod-create path: it may try harder than admission to win
        # its write against a burst of admissions.
        for _ in range(self.max_attempts * 4):
            try:
                quota = GPUQuota(obj)
            except QuotaError as exc:
                log.warning("invalid GPUQuota skipped", extra={"error": str(exc)})
                return
            status = await self._recount(quota)
            if status is None:
                self.metrics.observe(Ledger.of(quota))
                return
            try:
                stored = await self.store.write_status(status.raw)
            except Conflict:
                self.metrics.conflicts.labels("controller").inc()
                obj = await self.store.get(quota.namespace, quota.name)
                continue
            self.metrics.observe(Ledger.of(GPUQuota(stored)))
            return
        log.warning(
            "quota status kept changing; retried at the next pass",
            extra={"namespace": obj["metadata"].get("namespace"), "quota": obj["metadata"]["name"]},
        )

    async def _recount(self, quota: GPUQuota) -> GPUQuota | None:
        """The quota with its recounted status, or None when nothing changed."""
        namespace = quota.namespace
        live: list[Demand] = []
        seen: dict[str, bool] = {}  # uid → still holding quota
        at = self.clock()
        for pod in self.pods.objects(namespace):
            uid = str((pod.get("metadata") or {}).get("uid") or "")
            demand = pod_demand(pod)
            holding = demand is not None and not is_terminal(pod, at)
            seen[uid] = holding
            if holding:
                assert demand is not None
                live.append(demand)
        ledger = Ledger.of(quota)
        ledger.set_used(live)
        release: dict[str, str] = {}
        for uid, reservation in ledger.reservations.items():
            if uid in seen:
                release[uid] = "confirmed" if seen[uid] else "ended"
            elif (
                reservation.expires is not None
                and reservation.expires < at
                and not await self._pod_exists(namespace, reservation.pod, uid)
            ):
                release[uid] = "expired"
        ledger.release(release)
        status = ledger.status(quota.status)
        condition = Condition(
            type="Reconciled",
            status="True",
            reason="Counted",
            message=f"{len(live)} GPU pods counted, {len(ledger.reservations)} pending",
            last_transition_time=at,
        )
        previous = next((c for c in quota.status.conditions if c.type == "Reconciled"), None)
        if previous is not None and (previous.status, previous.message) == (
            condition.status,
            condition.message,
        ):
            condition = previous
        status = status.model_copy(
            update={"conditions": [condition], "observed_generation": quota.generation}
        )
        candidate = quota.with_status(status)
        if candidate.raw.get("status") == quota.raw.get("status"):
            return None
        candidate = quota.with_status(status.model_copy(update={"last_reconcile_time": at}))
        for uid, why in release.items():
            self.metrics.released.labels(why).inc()
            log.debug("reservation released", extra={"uid": uid, "why": why})
        return candidate

    async def _pod_exists(self, namespace: str, name: str, uid: str) -> bool:
        """Whether the pod of an expired reservation exists after all (the cache may lag)."""
        if not name or name.endswith("<generated>"):
            return False
        try:
            pod = await call_json(
                self.api, "GET", PODS.path(namespace, name), timeout_s=self.request_timeout_s
            )
        except KubeNotFound:
            return False
        except KubeError as err:
            raise Unavailable(f"pod {namespace}/{name}: {err}") from None
        except (TimeoutError, OSError) as err:
            raise Unavailable(f"pod {namespace}/{name}: {err}") from None
        return str((pod.get("metadata") or {}).get("uid")) == uid
