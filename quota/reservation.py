"""Reserving pods in one GPUQuota: a batch checked against it and written once, with CAS.

Every write is a **compare-and-swap** on the resourceVersion that was read; on 409 Conflict
(another replica, or the controller, wrote first) the quota is re-read and the batch re-checked
against the new state, a bounded number of times. A pod is denied only on a state read live:
the controller may have released since a cached one. An admission adds the pod's demand to
``status.used`` and records it among the quota's few most recent ``pending`` admissions, so a
repeated review of the same pod is not charged twice (:mod:`quota.ledger`). Reservations of
pods that a later quota denied are withdrawn here too, best effort: what is left expires in the
controller.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from quota.decision import Decision
from quota.demand import Demand
from quota.ledger import DEFAULT_PENDING_LIMIT, Ledger
from quota.metrics import QuotaMetrics
from quota.model import GPUQuota, QuotaError, now
from quota.staleness import Staleness
from quota.store import Conflict, NotFound, QuotaStore, Unavailable

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Waiter:
    """A pod waiting for its decision."""

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


# Pods queued for the namespace since the batch was taken; they join a retry.
Joined = Callable[[], list[Waiter]]


@dataclass
class _Tried:
    """One check of a batch against one state of the quota."""

    accepted: list[Waiter] = field(default_factory=list)
    denied: list[tuple[Waiter, str]] = field(default_factory=list)
    changed: bool = False  # whether the status must be written


class Reservations:
    def __init__(
        self,
        store: QuotaStore,
        metrics: QuotaMetrics,
        staleness: Staleness,
        *,
        max_attempts: int = 20,
        conflict_backoff_s: float = 0.005,
        pending_limit: int = DEFAULT_PENDING_LIMIT,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.staleness = staleness
        self.max_attempts = max_attempts
        self.conflict_backoff_s = conflict_backoff_s
        self.pending_limit = pending_limit

    def ledger(self, quota: GPUQuota) -> Ledger:
        return Ledger.of(quota, pending_limit=self.pending_limit)

    def _try(self, quota: GPUQuota, ledger: Ledger, waiters: list[Waiter]) -> _Tried:
        tried = _Tried()
        at = now()
        for waiter in waiters:
            held = ledger.holds(waiter.uid)
            violation = ledger.admit(waiter.uid, waiter.pod, waiter.demand, at)
            if violation is None:
                tried.accepted.append(waiter)
                tried.changed |= not held
            else:
                tried.denied.append((waiter, self.staleness.exceeded(quota, violation)))
        return tried

    async def reserve(
        self,
        namespace: str,
        quota: GPUQuota,
        waiters: list[Waiter],
        joined: Joined | None = None,
    ) -> list[Waiter]:
        """Reserve every waiter that fits ``quota``; deny the others. Returns the ones that fit.

        With ``joined`` (while this is the batch's first quota), pods queued meanwhile join a
        retry after a conflict: under a burst from several replicas a conflict then costs no
        extra write for them, which keeps the replicas from taking turns losing.
        """
        fresh = False  # whether ``quota`` was just read live (not from a cache)
        attempt = 0
        for _ in range(self.max_attempts):
            ledger = self.ledger(quota)
            tried = self._try(quota, ledger, waiters)
            if tried.denied and not fresh:
                # Never deny on a cached state: the controller may have released since.
                try:
                    quota = GPUQuota(await self.store.get(namespace, quota.name))
                except NotFound:
                    return list(waiters)
                fresh = True
                continue
            try:
                if tried.changed:
                    status = self.staleness.flag(quota, ledger.status(quota.status))
                    await self.store.write_status(quota.with_status(status).raw)
            except Conflict:
                self.metrics.conflicts.labels("admission").inc()
                # Another writer won: back off a little, at random, so that replicas stop
                # colliding in lockstep; pods arriving meanwhile join the retry.
                attempt += 1
                await asyncio.sleep(random.uniform(0, self.conflict_backoff_s * attempt))
                try:
                    raw, fresh = await self.store.reread(
                        namespace, quota.name, quota.resource_version
                    )
                except NotFound:
                    return list(waiters)  # deleted meanwhile: it limits nothing any more
                quota = GPUQuota(raw)
                if joined is not None:
                    waiters.extend(joined())
                continue
            except NotFound:
                return list(waiters)
            self.metrics.observe(ledger)
            for waiter, message in tried.denied:
                waiter.decide(Decision(False, message, "exceeded"))
            for waiter in tried.accepted:
                waiter.held.append(quota.name)
            return tried.accepted
        raise Unavailable(
            f'GPUQuota "{quota.name}" changed {self.max_attempts} times while this pod was being '
            f"admitted (too many concurrent writers)"
        )

    async def release(self, namespace: str, waiters: Sequence[Waiter]) -> None:
        """Best effort: what fails to be released here expires in the controller."""
        by_quota: dict[str, set[str]] = {}
        for waiter in waiters:
            for name in waiter.held:
                by_quota.setdefault(name, set()).add(waiter.uid)
        for name, uids in by_quota.items():
            for _ in range(self.max_attempts):
                try:
                    quota = GPUQuota(await self.store.get(namespace, name))
                    ledger = self.ledger(quota)
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
