"""Reserving a pod's demand in every GPUQuota of its namespace before the pod is allowed.

This follows kube-apiserver's own ResourceQuota admission (design K5):

* pods of one namespace are decided in **batches** by one worker per namespace (per replica):
  the worker reads the quotas once, checks every waiting pod in arrival order against a
  running copy, so later pods see earlier ones, and writes each quota's status once for the
  whole batch; a burst of N pods costs a few writes instead of N conflicting ones;
* every write is a **compare-and-swap** on the resourceVersion that was read; on 409 Conflict
  (another replica, or the controller, wrote first) the quota is re-read and the batch
  re-checked against the new state, a bounded number of times;
* a pod is allowed only when its reservation is **persisted** in every quota of the namespace;
  a pod denied by a later quota has its reservations in earlier ones released;
* a reservation is keyed by the pod's UID, so a repeated review of the same pod is not charged
  twice; the usage controller turns it into counted usage when the pod appears, and releases
  it when the pod never appears (expiry) or ends.

Hence no over-admission: a persisted status is always the result of applying the ledger check
to the exact state it replaced, and every allowed pod is in a persisted status.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from quota import messages
from quota.demand import Demand
from quota.ledger import Ledger, Reservation
from quota.metrics import QuotaMetrics
from quota.model import GPUQuota, QuotaError, now
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
        reservation_ttl_s: float | None = 120.0,
        timeout_s: float = 5.0,
        max_attempts: int = 20,
        require_quota: bool = False,
        conflict_backoff_s: float = 0.005,
    ) -> None:
        self.store = store
        self.metrics = metrics or QuotaMetrics()
        self.reservation_ttl_s = reservation_ttl_s
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self.require_quota = require_quota
        self.conflict_backoff_s = conflict_backoff_s
        self._queues: dict[str, list[_Waiter]] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}

    async def decide(
        self, namespace: str, uid: str, pod: str, demand: Demand, *, dry_run: bool = False
    ) -> Decision:
        """Check ``demand`` against every quota of ``namespace`` and, unless dry-run, reserve it."""
        try:
            if dry_run:
                return await asyncio.wait_for(self._check(namespace, demand), self.timeout_s)
            loop = asyncio.get_running_loop()
            waiter = _Waiter(uid, pod, demand, loop.create_future())
            self._queues.setdefault(namespace, []).append(waiter)
            if namespace not in self._workers:
                self._workers[namespace] = asyncio.create_task(
                    self._drain(namespace), name=f"quota-{namespace}"
                )
            # shield: a timed-out pod must not cancel the batch other pods are waiting on.
            return await asyncio.wait_for(asyncio.shield(waiter.future), self.timeout_s)
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
            violation = Ledger.of(quota).check(demand)
            if violation is not None:
                return Decision(False, messages.exceeded(violation), "exceeded")
        return Decision(True, reason="dry-run")

    async def _quotas(self, namespace: str) -> list[GPUQuota] | Decision:
        """The namespace's quotas, or the decision for every pod when there are none to use."""
        raws = await self.store.list(namespace)
        if not raws:
            return Decision(not self.require_quota, reason="no-quota")
        try:
            return sorted((GPUQuota(raw) for raw in raws), key=lambda q: q.name)
        except QuotaError as exc:
            return Decision(False, str(exc), "invalid-quota")

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
        expires = None
        if self.reservation_ttl_s is not None:
            expires = now() + timedelta(seconds=self.reservation_ttl_s)
        pending = list(batch)
        for index, quota in enumerate(quotas):
            if not pending:
                break
            # Pods that arrive while the first quota's write is retried join the retry.
            absorb = batch if index == 0 else None
            pending = await self._reserve_in(namespace, quota, pending, expires, absorb)
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
        return decision

    async def _reserve_in(
        self,
        namespace: str,
        quota: GPUQuota,
        waiters: list[_Waiter],
        expires: datetime | None,
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
            ledger = Ledger.of(quota)
            before = len(ledger.reservations)
            accepted: list[_Waiter] = []
            denied: list[tuple[_Waiter, str]] = []
            for waiter in waiters:
                violation = ledger.reserve(
                    Reservation(waiter.uid, waiter.pod, waiter.demand, expires)
                )
                if violation is None:
                    accepted.append(waiter)
                else:
                    denied.append((waiter, messages.exceeded(violation)))
            if denied and not fresh:
                # Never deny on a cached state: the controller may have released since.
                try:
                    quota = GPUQuota(await self.store.get(namespace, quota.name))
                except NotFound:
                    return list(waiters)
                fresh = True
                continue
            try:
                if len(ledger.reservations) != before:
                    await self.store.write_status(
                        quota.with_status(ledger.status(quota.status)).raw
                    )
            except Conflict:
                self.metrics.conflicts.labels("admission").inc()
                # Another writer won: back off a little, at random, so that replicas stop
                # colliding in lockstep; pods arriving meanwhile join the retry (absorb).
                attempt += 1
                await asyncio.sleep(random.uniform(0, self.conflict_backoff_s * attempt))
                try:
                    quota = GPUQuota(await self.store.get(namespace, quota.name))
                except NotFound:
                    return list(waiters)  # deleted meanwhile: it limits nothing any more
                fresh = True
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
                    ledger = Ledger.of(quota)
                    if not ledger.release(uids):
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
                        "could not release reservations; they expire",
                        extra={"namespace": namespace, "quota": name, "error": str(exc)},
                    )
                    break
