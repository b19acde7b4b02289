"""The usage controller: ``status.used`` recounted from the pods that exist.

Usage is recomputed from the informer's cache, never kept as increments, so a relist (410),
a restart or a missed event heals completely. For each GPUQuota, ``used`` becomes the sum of:

* every non-terminal pod of the namespace that holds canonical GPU resources (terminal as
  Kubernetes' own quota defines it, :func:`quota.demand.is_terminal`);
* every ``pending`` admission whose pod the controller cannot see yet. An entry leaves
  ``pending`` when its pod is in the cache (it is counted as a pod now: *confirmed*), when the
  pod was seen to end or be deleted (*ended*), or when it is older than the grace and a direct
  GET shows no pod of that name and UID (*expired*: the create failed after admission);
* the ``unmatched`` aggregate of older admissions, less the pods that appeared since the
  previous recount without a pending entry (those are the pods it stands for); it is dropped
  whole once its newest admission is older than the grace, when every pod it stands for
  either exists or never will (that recount lists the namespace's pods live: the cache may lag).

The write is a compare-and-swap on the version read, so it never erases an admission written
meanwhile: on 409 the controller re-reads and recomputes. A pod is therefore charged at least
once from its admission until it ends: usage may be over-counted for a moment, never under.
docs/quota.md gives the whole argument, including the grace it relies on.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry

from core.informer import Informers, InformerSettings
from core.kube import GPUQUOTAS, PODS, Api, KubeError, KubeNotFound, call_json
from quota.claims import ClaimSpecs, claim_refs
from quota.demand import CardMemory, Demand, is_terminal, pod_demand
from quota.ledger import DEFAULT_PENDING_LIMIT, Ledger, Pending, Scoped
from quota.metrics import QuotaMetrics
from quota.model import CONTROLLER_ACTIVE, COUNTED, Condition, GPUQuota, QuotaError, now
from quota.store import Conflict, NotFound, QuotaStore, Unavailable

log = logging.getLogger(__name__)

# Pod UIDs seen deleted, remembered so that an admission whose pod came and went between two
# passes is released at once instead of after the grace. Bounded: older ones fall back to it.
_DELETED_MEMORY = 10_000


def _uid(pod: Mapping[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("uid") or "")


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
        self.card_memory = card_memory
        self.claims = claims
        self.store = store
        self.metrics = metrics or QuotaMetrics(CollectorRegistry())
        self.resync_s = resync_s
        self.debounce_s = debounce_s
        self.min_interval_s = min_interval_s
        self.max_attempts = max_attempts
        self.request_timeout_s = request_timeout_s
        self.grace = timedelta(seconds=grace_s)
        self.pending_limit = pending_limit
        self.clock = clock
        settings = InformerSettings(request_timeout_s=request_timeout_s)
        informers = informers or Informers(api, settings=settings)
        self.pods = informers.of(PODS)
        self.quotas = informers.of(GPUQUOTAS)
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self._deleted: OrderedDict[str, None] = OrderedDict()
        self._demands: dict[str, Demand | None] = {}  # per pod UID, as of its last event
        # Per quota UID: the pods counted in the last status this controller wrote (None until
        # its first write: then it cannot tell which pods are new, and subtracts nothing).
        self._accounted: dict[str, set[str]] = {}
        # Per quota UID: admissions dropped as expired, should their pod appear after all.
        self._expired: dict[str, set[str]] = {}
        # Per namespace: when its next pending admission or unmatched aggregate falls due.
        self._due: dict[str, datetime] = {}
        # Per namespace: when it was last reconciled (monotonic), and those that must not wait.
        self._last: dict[str, float] = {}
        self._urgent: set[str] = set()

    # --- events ---------------------------------------------------------------------------

    def _on_pod(self, kind: str, pod: Mapping[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        namespace = meta.get("namespace")
        uid = str(meta.get("uid") or "")
        demand = pod_demand(pod, self.card_memory, self.claims)
        # Each recount reads every pod of the namespace: computed once per change, here. A
        # pod whose claims are not read yet is computed at the recount, which reads them.
        if kind == "DELETED" or (demand is not None and demand.missing_claims):
            self._demands.pop(uid, None)
        else:
            self._demands[uid] = demand
        if namespace and demand is not None:
            if kind == "DELETED":
                self._deleted[uid] = None
                while len(self._deleted) > _DELETED_MEMORY:
                    self._deleted.popitem(last=False)
            self._mark(str(namespace))

    def _on_quota(self, kind: str, raw: Mapping[str, Any]) -> None:
        meta = raw.get("metadata") or {}
        namespace = str(meta.get("namespace") or "")
        if kind == "DELETED":
            uid = str(meta.get("uid") or "")
            self._accounted.pop(uid, None)
            self._expired.pop(uid, None)
            self.metrics.forget(namespace, str(meta.get("name") or ""))
            return
        status = raw.get("status") or {}
        try:
            counted = GPUQuota(raw).counted()
        except QuotaError:
            counted = False
        # A new or changed quota is counted at once (admission waits for it); admissions
        # the controller has not matched yet are looked at as soon as they are written.
        if not counted:
            self._urgent.add(namespace)
        if not counted or status.get("pending") or status.get("unmatched"):
            self._mark(namespace)

    def _mark(self, namespace: str) -> None:
        self._dirty.add(namespace)
        self._wake.set()

    # --- loop -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Watch pods and GPUQuotas and reconcile until cancelled."""
        self.pods.add_handler(self._on_pod)
        self.quotas.add_handler(self._on_quota)
        self.pods.start()
        self.quotas.start()
        try:
            await self.pods.wait_synced()
            await self.quotas.wait_synced()
            while True:
                await self.reconcile_all()
                await self._until_resync()
        finally:
            self.pods.remove_handler(self._on_pod)
            self.quotas.remove_handler(self._on_quota)
            await self.pods.stop()
            await self.quotas.stop()

    async def _until_resync(self) -> None:
        """Reconcile namespaces whose pods or quotas changed, or whose admissions fall due,
        in small batches, until the periodic full pass is due."""
        deadline = time.monotonic() + self.resync_s
        while (left := deadline - time.monotonic()) > 0:
            due = min(self._due.values(), default=None)
            if due is not None:
                left = min(left, max(0.0, (due - self.clock()).total_seconds()))
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                at = self.clock()
                for namespace, when in list(self._due.items()):
                    if when <= at:
                        self._dirty.add(namespace)
                if not self._dirty:
                    continue
            await asyncio.sleep(self.debounce_s)
            self._wake.clear()
            dirty, self._dirty = self._dirty, set()
            urgent, self._urgent = self._urgent, set()
            for namespace in sorted(dirty):
                # At most one pass per namespace per min_interval_s: under a burst every
                # admission changes the quota, and each controller write would make the
                # webhooks' next write conflict. A quota admission waits for goes at once.
                since = time.monotonic() - self._last.get(namespace, -math.inf)
                if namespace not in urgent and since < self.min_interval_s:
                    later = self.clock() + timedelta(seconds=self.min_interval_s - since)
                    self._due[namespace] = min(self._due.get(namespace, later), later)
                    continue
                self._last[namespace] = time.monotonic()
                await self._guarded(namespace)

    async def _guarded(self, namespace: str | None) -> None:
        try:
            if namespace is not None:
                self._due.pop(namespace, None)
            else:
                self._due.clear()
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
        obj = dict(raw)
        # The controller is off the pod-create path: it may try harder than admission to win
        # its write against a burst of admissions.
        attempt = 0
        for _ in range(self.max_attempts * 4):
            quota = self._readable(obj)
            if quota is None:
                return
            candidate, live = await self._recount(quota)
            if candidate is None:
                # What is persisted is what a write would have said: the same pods counted.
                self._accounted[quota.uid] = live
                self.metrics.observe(Ledger.of(quota))
                return
            try:
                stored = await self.store.write_status(candidate.raw)
            except Conflict:
                self.metrics.conflicts.labels("controller").inc()
                # Admissions won: step aside a little, at random, rather than recount and lose
                # again at their pace (each try costs the API server a read and a write).
                attempt += 1
                await asyncio.sleep(random.uniform(0, min(0.2, 0.01 * attempt)))
                obj = await self.store.get(quota.namespace, quota.name)
                continue
            self._accounted[quota.uid] = live
            self.metrics.observe(Ledger.of(GPUQuota(stored)))
            return
        log.warning(
            "quota status kept changing; retried at the next pass",
            extra={"namespace": obj["metadata"].get("namespace"), "quota": obj["metadata"]["name"]},
        )

    async def count(self, raw: Mapping[str, Any]) -> None:
        """Count one GPUQuota that is not counted yet, from a live list of its namespace's pods,
        without running the controller: what a replica does for a quota its pods are waiting
        on when no leader has counted it (the leader crashed and its Lease has not expired, or
        it is slow). The same recount and compare-and-swap write as :meth:`reconcile`, once:
        on a conflict someone else wrote (the leader, or another replica counting too), and
        what they wrote is read again. Leaves ``ControllerActive`` as it was: this replica
        does not match admissions afterwards; the leader, when there is one again, does.
        Raises :class:`Unavailable` when the API server cannot be reached."""
        obj = dict(raw)
        for _ in range(3):
            quota = self._readable(obj)
            if quota is None or quota.counted():
                return
            candidate, live = await self._recount(quota, fresh=True, active=False)
            if candidate is None:
                return
            try:
                await self.store.write_status(candidate.raw)
            except Conflict:
                self.metrics.conflicts.labels("count").inc()
                obj = await self.store.get(quota.namespace, quota.name)
                continue
            self.metrics.first_counts.inc()
            log.info(
                "GPUQuota counted by admission (no controller had counted it)",
                extra={"namespace": quota.namespace, "quota": quota.name, "pods": len(live)},
            )
            return

    @staticmethod
    def _readable(obj: dict[str, Any]) -> GPUQuota | None:
        """The quota; one whose status cannot be read is rebuilt from an empty status (the
        recount restores everything but admissions not yet seen as pods, docs/quota.md)."""
        try:
            return GPUQuota(obj)
        except QuotaError as exc:
            try:
                quota = GPUQuota({**obj, "status": {}})
            except QuotaError:
                log.warning("invalid GPUQuota skipped", extra={"error": str(exc)})
                return None
            log.warning(
                "GPUQuota status unreadable; rebuilding it from the pods",
                extra={"namespace": quota.namespace, "quota": quota.name, "error": str(exc)},
            )
            return quota

    async def _recount(
        self, quota: GPUQuota, *, fresh: bool = False, active: bool = True
    ) -> tuple[GPUQuota | None, set[str]]:
        """The quota with its recounted status (None when nothing changed) and the pods it
        counted. ``fresh``: from a live list of pods, never the cache; ``active``: say in the
        status that the controller matches admissions (it is this one)."""
        namespace = quota.namespace
        at = self.clock()
        ledger = Ledger.of(quota, pending_limit=self.pending_limit)
        newest = ledger.unmatched_newest
        if fresh or (not ledger.unmatched.empty and (newest is None or at - newest > self.grace)):
            # `unmatched` is about to be dropped whole: its pods must then be counted as pods,
            # so count from a live list, not from a cache that may lag.
            pods: Sequence[Mapping[str, Any]] = await self._list_pods(namespace)
            cached = False
        else:
            pods, cached = self.pods.objects(namespace), True
        known = self._demands if cached else {}
        if self.claims is not None:
            # Only pods whose demand is not known yet: the others' claims were read already.
            await self.claims.load(
                ref for pod in pods if _uid(pod) not in known for ref in claim_refs(pod)
            )
        live: dict[str, Demand] = {}
        ended: set[str] = set()
        for pod in pods:
            uid = _uid(pod)
            demand = known[uid] if uid in known else pod_demand(pod, self.card_memory, self.claims)
            if demand is None:
                continue
            if is_terminal(pod, at):
                ended.add(uid)
            else:
                live[uid] = demand
        expired = self._expired.setdefault(quota.uid, set())
        released: dict[str, str] = {}
        keep: list[Pending] = []
        for entry in ledger.pending:
            if entry.uid in live:
                released[entry.uid] = "confirmed"
            elif entry.uid in ended or entry.uid in self._deleted:
                released[entry.uid] = "ended"
            elif at - entry.at > self.grace and not await self._pod_exists(
                namespace, entry.pod, entry.uid
            ):
                released[entry.uid] = "expired"
            else:
                keep.append(entry)
        unmatched = self._unmatched(quota, ledger, live, at, released)
        ledger.recount(live, keep, unmatched)
        self._schedule(namespace, ledger)
        status = ledger.status(quota.status).with_condition(
            Condition(
                type=COUNTED,
                status="True",
                reason="Counted",
                message=f"{len(live)} GPU pods counted, {len(keep)} admissions pending",
                last_transition_time=at,
            )
        )
        if active:
            status = status.with_condition(
                Condition(
                    type=CONTROLLER_ACTIVE,
                    status="True",
                    reason="Matching",
                    message="the fracgpu quota controller matches admissions to pods",
                    last_transition_time=at,
                )
            )
        status = status.model_copy(update={"observed_generation": quota.generation})
        candidate = quota.with_status(status)
        if candidate.raw.get("status") == quota.raw.get("status"):
            return None, set(live)
        candidate = quota.with_status(status.model_copy(update={"last_reconcile_time": at}))
        for uid, why in released.items():
            self.metrics.released.labels(why).inc()
            if why == "expired":
                expired.add(uid)
            log.debug("admission released", extra={"uid": uid, "why": why})
        return candidate, set(live)

    def _unmatched(
        self,
        quota: GPUQuota,
        ledger: Ledger,
        live: Mapping[str, Demand],
        at: datetime,
        released: dict[str, str],
    ) -> Scoped | None:
        """What the ``unmatched`` aggregate still stands for (None: nothing)."""
        unmatched = ledger.unmatched
        if unmatched.empty:
            return None
        newest = ledger.unmatched_newest
        if newest is None or at - newest > self.grace:
            released["<unmatched>"] = "unmatched"
            return None
        accounted = self._accounted.get(quota.uid)
        if accounted is None:
            return unmatched  # cannot tell which pods are new: keep it all until it is due
        pending = {entry.uid for entry in ledger.pending}
        skip = accounted | pending | self._expired.get(quota.uid, set())
        for uid, demand in live.items():
            if uid not in skip:
                unmatched.remove(demand, ledger.spec)
        return unmatched

    def _schedule(self, namespace: str, ledger: Ledger) -> None:
        """Remember when this namespace must be looked at again even if nothing happens."""
        times = [entry.at for entry in ledger.pending]
        if not ledger.unmatched.empty and ledger.unmatched_newest is not None:
            times.append(ledger.unmatched_newest)
        if not times:
            return
        due = min(times) + self.grace + timedelta(milliseconds=10)
        current = self._due.get(namespace)
        if current is None or due < current:
            self._due[namespace] = due

    async def _list_pods(self, namespace: str) -> list[dict[str, Any]]:
        """Every pod of the namespace, read live (a consistent list, page by page)."""
        pods: list[dict[str, Any]] = []
        token = ""
        while True:
            query = [("limit", "500")] + ([("continue", token)] if token else [])
            try:
                page = await call_json(
                    self.api,
                    "GET",
                    PODS.path(namespace),
                    query=query,
                    timeout_s=self.request_timeout_s,
                )
            except (KubeError, TimeoutError, OSError, aiohttp.ClientError) as err:
                raise Unavailable(f"pods of {namespace}: {err}") from None
            pods.extend(p for p in page.get("items") or [] if isinstance(p, dict))
            token = str((page.get("metadata") or {}).get("continue") or "")
            if not token:
                return pods

    async def _pod_exists(self, namespace: str, name: str, uid: str) -> bool:
        """Whether the pod of an expired admission exists after all (the cache may lag)."""
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
        except (TimeoutError, OSError, aiohttp.ClientError) as err:
            raise Unavailable(f"pod {namespace}/{name}: {err}") from None
        return str((pod.get("metadata") or {}).get("uid")) == uid
