"""Reserving a pod's demand in every GPUQuota of its namespace before the pod is allowed.

This follows kube-apiserver's own ResourceQuota admission:

* pods of one namespace are decided in **batches** by one worker per namespace (per replica):
  the worker reads the quotas once, checks every waiting pod in arrival order against a
  running copy, so later pods see earlier ones, and writes each quota's status once for the
  whole batch; a burst of N pods costs a few writes instead of N conflicting ones;
* every write is a **compare-and-swap** on the resourceVersion that was read; on 409 Conflict
  (another replica, or the controller, wrote first) the quota is re-read and the batch
  re-checked against the new state, a bounded number of times;
* a pod is allowed only when its reservation is **persisted** in every quota of the namespace;
  a pod denied by a later quota has its reservations in earlier ones released;
* an admission adds the pod's demand to ``status.used`` and records it (pod UID, demand,
  time) among the quota's few most recent ``pending`` admissions, so a repeated review of the
  same pod is not charged twice; the usage controller matches it to the pod when the pod
  appears, and drops it when the pod never appears or ends (:mod:`quota.ledger`);
* a quota the controller has not counted yet (new, spec changed, status reset) is not used:
  its pods are denied with a message that says so, as Kubernetes' ResourceQuota does.

Hence no over-admission: a persisted status is always the result of applying the ledger check
to the exact state it replaced, and every allowed pod is in a persisted status.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry

from quota import messages
from quota.demand import Demand
from quota.ledger import DEFAULT_PENDING_LIMIT, Ledger, Violation
from quota.metrics import QuotaMetrics
from quota.model import CONTROLLER_ACTIVE, Condition, GPUQuota, QuotaError, QuotaStatus, now
from quota.store import Conflict, NotFound, QuotaStore, Unavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    message: str = ""
    # A short fixed reason for metrics and logs.
    reason: str = "fits"


@dataclass(eq=False)
class _Waiter:
    uid: str
    pod: str
    demand: Demand
    future: asyncio.Future[Decision]
    held: list[str] = field(default_factory=list)  # quotas that hold its reservation

    def decide(self, decision: Decision) -> None:
        if not self.future.done():
            self.future.set_result(decision)

    @property
    def denied(self) -> bool:
        return self.future.done() and not self.future.result().allowed


class Reserver:
    """Decides GPU pods against the GPUQuotas of their namespace; see the module docstring."""

    def __init__(
        self,
        store: QuotaStore,
        *,
        metrics: QuotaMetrics | None = None,
        timeout_s: float = 5.0,
        max_attempts: int = 20,
        require_quota: bool = False,
        conflict_backoff_s: float = 0.005,
        pending_limit: int = DEFAULT_PENDING_LIMIT,
        controller: bool = True,
        stale_after_s: float = 60.0,
        count_wait_s: float = 2.0,
        counter: Callable[[Mapping[str, Any]], Awaitable[None]] | None = None,
        handover_s: float = 0.3,
    ) -> None:
        """``controller``: whether a usage controller counts pods (Kubernetes mode). Without
        one (embedded mode) a quota is used as it is and admissions are never matched.
        ``stale_after_s``: an admission still unmatched this long means the controller is not
        doing its work; admission then says so (condition, metric, log, denial text).
        ``count_wait_s``: how long a pod waits for a new quota to be counted before it is
        denied. ``counter``: counts a quota from the pods when no controller has after
        ``handover_s`` (the leader crashed and its Lease has not expired, or it is slow), so
        that a new or restarted replica admits into every quota from its first request."""
        self.store = store
        self.metrics = metrics or QuotaMetrics(CollectorRegistry())
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self.require_quota = require_quota
        self.conflict_backoff_s = conflict_backoff_s
        self.pending_limit = pending_limit
        self.controller = controller
        self.stale_after_s = stale_after_s
        self.count_wait_s = count_wait_s
        self.counter = counter
        self.handover_s = min(handover_s, count_wait_s / 2)
        self._queues: dict[str, list[_Waiter]] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._stale: set[tuple[str, str]] = set()  # quotas already reported as unmatched

    async def decide(
        self,
        namespace: str,
        uid: str,
        pod: str,
        demand: Demand,
        *,
        dry_run: bool = False,
        timeout_s: float | None = None,
    ) -> Decision:
        """Check ``demand`` against every quota of ``namespace`` and, unless dry-run, reserve it.
        ``timeout_s``: what is left of the decision's time (default: all of ``timeout_s``)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            if dry_run:
                return await asyncio.wait_for(self._check(namespace, demand), timeout)
            loop = asyncio.get_running_loop()
            waiter = _Waiter(uid, pod, demand, loop.create_future())
            self._queues.setdefault(namespace, []).append(waiter)
            if namespace not in self._workers:
                self._workers[namespace] = asyncio.create_task(
                    self._drain(namespace), name=f"quota-{namespace}"
                )
            # shield: a timed-out pod must not cancel the batch other pods are waiting on.
            return await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
        except TimeoutError:
            # If the write lands after this, the reservation belongs to a pod that is never
            # persisted: the controller releases it when it expires.
            return self._unverifiable(
                namespace,
                demand,
                f"the Kubernetes API server did not answer within {self.timeout_s:g}s",
            )
        except Unavailable as exc:
            return self._unverifiable(namespace, demand, str(exc))

    def _unverifiable(self, namespace: str, demand: Demand, why: str) -> Decision:
        return Decision(False, messages.unverifiable(namespace, demand, why), "unverifiable")

    async def close(self) -> None:
        workers = list(self._workers.values())
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)

    # --- dry run -------------------------------------------------------------------------

    async def _check(self, namespace: str, demand: Demand) -> Decision:
        quotas = await self._quotas(namespace)
        if isinstance(quotas, Decision):
            return self._explain(namespace, demand, quotas)
        for quota in quotas:
            violation = self._ledger(quota).check(demand)
            if violation is not None:
                return Decision(False, self._exceeded(quota, violation), "exceeded")
        return Decision(True, reason="dry-run")

    def _ledger(self, quota: GPUQuota) -> Ledger:
        return Ledger.of(quota, pending_limit=self.pending_limit)

    def _exceeded(self, quota: GPUQuota, violation: Violation) -> str:
        message = messages.exceeded(violation)
        since = self._unmatched_since(quota)
        if since is not None:
            message += messages.controller_behind(since)
        return message

    def _unmatched_since(self, quota: GPUQuota) -> datetime | None:
        """The oldest admission still unmatched, when it is older than ``stale_after_s``."""
        if not self.controller:
            return None
        status = quota.status
        times = [p.at for p in status.pending]
        if status.unmatched is not None and status.unmatched.newest is not None:
            times.append(status.unmatched.newest)
        if not times:
            return None
        oldest = min(times)
        return oldest if (now() - oldest).total_seconds() > self.stale_after_s else None

    async def _quotas(self, namespace: str) -> list[GPUQuota] | Decision:
        """The namespace's quotas, or the decision for every pod when there are none to use."""
        try:
            raws = await self.store.list(namespace)
        except NotFound:
            # Listing a kind fails with 404 only when its CRD is not installed.
            return Decision(False, reason="no-crd")
        if not raws:
            return Decision(not self.require_quota, reason="no-quota")
        try:
            quotas = sorted((GPUQuota(raw) for raw in raws), key=lambda q: q.name)
        except QuotaError as exc:
            return Decision(False, str(exc), "invalid-quota")
        if self.controller:
            for index, quota in enumerate(quotas):
                if quota.counted():
                    continue
                try:
                    fresh = await self._counted(namespace, quota.name)
                except NotFound:
                    continue  # deleted meanwhile: it limits nothing any more
                except QuotaError as exc:
                    return Decision(False, str(exc), "invalid-quota")
                if not fresh.counted():
                    return Decision(False, messages.not_counted(fresh), "not-counted")
                quotas[index] = fresh
        return quotas

    async def _counted(self, namespace: str, name: str) -> GPUQuota:
        """The quota read live, waiting up to ``count_wait_s`` for it to be counted: a quota
        created just before its pods (one `kubectl apply` of both) then admits them instead of
        denying the first ones. The leader's controller counts a new quota within a moment of
        seeing it; when it has not after ``handover_s`` this replica counts it itself (the
        same count, a compare-and-swap write), so a quota is never unusable for as long as a
        crashed leader's Lease takes to expire. Never decided on a cached state."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + self.count_wait_s
        tried = self.counter is None
        while True:
            quota = GPUQuota(await self.store.get(namespace, name))
            at = loop.time()
            if quota.counted() or at >= deadline:
                return quota
            if not tried and at >= start + self.handover_s:
                tried = True
                assert self.counter is not None
                try:
                    await asyncio.wait_for(self.counter(quota.raw), deadline - at)
                except (Unavailable, TimeoutError) as exc:
                    log.warning(
                        "could not count GPUQuota",
                        extra={"quota": quota.ref, "error": str(exc) or type(exc).__name__},
                    )
                continue
            await asyncio.sleep(0.05)

    # --- reservations --------------------------------------------------------------------

    async def _drain(self, namespace: str) -> None:
        try:
            while self._queues.get(namespace):
                batch = self._queues.pop(namespace)
                try:
                    await self._process(namespace, batch)
                except Exception as exc:
                    why = str(exc) if isinstance(exc, Unavailable) else "internal error"
                    if not isinstance(exc, Unavailable):
                        log.exception("quota batch failed", extra={"namespace": namespace})
                    for waiter in batch:
                        waiter.decide(self._unverifiable(namespace, waiter.demand, why))
                    await self._release(namespace, [w for w in batch if w.denied and w.held])
        finally:
            self._workers.pop(namespace, None)

    async def _process(self, namespace: str, batch: list[_Waiter]) -> None:
        quotas = await self._quotas(namespace)
        if isinstance(quotas, Decision):
            for waiter in batch:
                waiter.decide(self._explain(namespace, waiter.demand, quotas))
            return
        pending = list(batch)
        for index, quota in enumerate(quotas):
            if not pending:
                break
            # Pods that arrive while the first quota's write is retried join the retry.
            absorb = batch if index == 0 else None
            pending = await self._reserve_in(namespace, quota, pending, absorb)
        for waiter in pending:
            waiter.decide(Decision(True))
        await self._release(namespace, [w for w in batch if w.denied and w.held])

    @staticmethod
    def _explain(namespace: str, demand: Demand, decision: Decision) -> Decision:
        """Phrase a namespace-wide decision (no quota, or an unusable one) for one pod."""
        if decision.reason == "no-quota" and not decision.allowed:
            return Decision(False, messages.no_quota(namespace, demand), "no-quota")
        if decision.reason == "invalid-quota":
            message = messages.invalid_quota(namespace, decision.message)
            return Decision(False, message, "invalid-quota")
        if decision.reason == "no-crd":
            return Decision(False, messages.crd_missing(namespace, demand), "no-crd")
        if decision.reason == "not-counted":
            message = messages.not_counted_for(namespace, demand, decision.message)
            return Decision(False, message, "not-counted")
        return decision

    async def _reserve_in(
        self,
        namespace: str,
        quota: GPUQuota,
        waiters: list[_Waiter],
        absorb: list[_Waiter] | None = None,
    ) -> list[_Waiter]:
        """Reserve every waiter that fits ``quota``; deny the others. Returns the ones that fit.

        With ``absorb`` (the batch, while this is its first quota), pods queued meanwhile join
        a retry after a conflict: under a burst from several replicas a conflict then costs no
        extra write for them, which keeps the replicas from taking turns losing.
        """
        fresh = False  # whether ``quota`` was just read live (not from a cache)
        attempt = 0
        for _ in range(self.max_attempts):
            ledger = self._ledger(quota)
            at = now()
            changed = False
            accepted: list[_Waiter] = []
            denied: list[tuple[_Waiter, str]] = []
            for waiter in waiters:
                held = ledger.holds(waiter.uid)
                violation = ledger.admit(waiter.uid, waiter.pod, waiter.demand, at)
                if violation is None:
                    accepted.append(waiter)
                    changed |= not held
                else:
                    denied.append((waiter, self._exceeded(quota, violation)))
            if denied and not fresh:
                # Never deny on a cached state: the controller may have released since.
                try:
                    quota = GPUQuota(await self.store.get(namespace, quota.name))
                except NotFound:
                    return list(waiters)
                fresh = True
                continue
            try:
                if changed:
                    status = self._flag_unmatched(quota, ledger.status(quota.status))
                    await self.store.write_status(quota.with_status(status).raw)
            except Conflict:
                self.metrics.conflicts.labels("admission").inc()
                # Another writer won: back off a little, at random, so that replicas stop
                # colliding in lockstep; pods arriving meanwhile join the retry (absorb).
                attempt += 1
                await asyncio.sleep(random.uniform(0, self.conflict_backoff_s * attempt))
                try:
                    raw, fresh = await self.store.reread(
                        namespace, quota.name, quota.resource_version
                    )
                except NotFound:
                    return list(waiters)  # deleted meanwhile: it limits nothing any more
                quota = GPUQuota(raw)
                if absorb is not None:
                    joined = self._queues.pop(namespace, [])
                    waiters.extend(joined)
                    absorb.extend(joined)
                continue
            except NotFound:
                return list(waiters)
            self.metrics.observe(ledger)
            for waiter, message in denied:
                waiter.decide(Decision(False, message, "exceeded"))
            for waiter in accepted:
                waiter.held.append(quota.name)
            return accepted
        raise Unavailable(
            f'GPUQuota "{quota.name}" changed {self.max_attempts} times while this pod was being '
            f"admitted (too many concurrent writers)"
        )

    def _flag_unmatched(self, quota: GPUQuota, status: QuotaStatus) -> QuotaStatus:
        """Say on the quota, in the write admission makes anyway, that the controller is not
        matching admissions to pods (so nothing that ended is released); log it once."""
        since = self._unmatched_since(quota)
        key = (quota.namespace, quota.name)
        self.metrics.unmatched_age.labels(*key).set(
            0 if since is None else (now() - since).total_seconds()
        )
        if since is None:
            self._stale.discard(key)
            return status
        if key not in self._stale:
            self._stale.add(key)
            log.warning(
                "quota admissions are not being matched to pods: is the quota controller running?",
                extra={"namespace": key[0], "quota": key[1], "unmatched_since": since.isoformat()},
            )
        return status.with_condition(
            Condition(
                type=CONTROLLER_ACTIVE,
                status="False",
                reason="AdmissionsUnmatched",
                message=messages.controller_behind(since).lstrip("; "),
                last_transition_time=now(),
            )
        )

    async def _release(self, namespace: str, waiters: Sequence[_Waiter]) -> None:
        """Best effort: what fails to be released here expires in the controller."""
        by_quota: dict[str, set[str]] = {}
        for waiter in waiters:
            for name in waiter.held:
                by_quota.setdefault(name, set()).add(waiter.uid)
        for name, uids in by_quota.items():
            for _ in range(self.max_attempts):
                try:
                    quota = GPUQuota(await self.store.get(namespace, name))
                    ledger = self._ledger(quota)
                    if not ledger.withdraw(uids):
                        break
                    await self.store.write_status(
                        quota.with_status(ledger.status(quota.status)).raw
                    )
                    self.metrics.released.labels("denied").inc(len(uids))
                    self.metrics.observe(ledger)
                    break
                except Conflict:
                    self.metrics.conflicts.labels("admission").inc()
                except (NotFound, QuotaError, Unavailable) as exc:
                    log.warning(
                        "could not withdraw admissions; the controller drops them",
                        extra={"namespace": namespace, "quota": name, "error": str(exc)},
                    )
                    break
