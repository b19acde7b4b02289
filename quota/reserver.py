"""Reserving a pod's demand in every GPUQuota of its namespace before the pod is allowed.

This follows kube-apiserver's own ResourceQuota admission:

* pods of one namespace are decided in **batches** by one worker per namespace (per replica):
  the worker reads the quotas once, checks every waiting pod in arrival order against a
  running copy, so later pods see earlier ones, and writes each quota's status once for the
  whole batch; a burst of N pods costs a few writes instead of N conflicting ones;
* every write is a **compare-and-swap** on the resourceVersion that was read, re-checked on
  409 Conflict a bounded number of times (:mod:`quota.reservation`);
* a pod is allowed only when its reservation is **persisted** in every quota of the namespace;
  a pod denied by a later quota has its reservations in earlier ones released;
* an admission is recorded among the quota's ``pending`` admissions, which the usage
  controller matches to the pod when the pod appears, and drops when the pod never appears or
  ends (:mod:`quota.ledger`);
* a quota the controller has not counted yet (new, spec changed, status reset) is not used:
  its pods are denied with a message that says so, as Kubernetes' ResourceQuota does
  (:mod:`quota.usable`).

Hence no over-admission: a persisted status is always the result of applying the ledger check
to the exact state it replaced, and every allowed pod is in a persisted status.
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry

from quota.decision import Decision, explain, unverifiable
from quota.demand import Demand
from quota.ledger import DEFAULT_PENDING_LIMIT
from quota.metrics import QuotaMetrics
from quota.reservation import Reservations, Waiter
from quota.staleness import Staleness
from quota.store import QuotaStore, Unavailable
from quota.usable import QuotaCounter, UsableQuotas

log = logging.getLogger(__name__)


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
        counter: QuotaCounter | None = None,
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
        self.usable = UsableQuotas(
            store,
            require_quota=require_quota,
            controller=controller,
            count_wait_s=count_wait_s,
            counter=counter,
            handover_s=handover_s,
        )
        self.staleness = Staleness(self.metrics, controller=controller, stale_after_s=stale_after_s)
        self.reservations = Reservations(
            store,
            self.metrics,
            self.staleness,
            max_attempts=max_attempts,
            conflict_backoff_s=conflict_backoff_s,
            pending_limit=pending_limit,
        )
        self._queues: dict[str, list[Waiter]] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}

    @property
    def counter(self) -> QuotaCounter | None:
        """What counts a quota no controller has counted (settable: tests replace it)."""
        return self.usable.counter

    @counter.setter
    def counter(self, counter: QuotaCounter | None) -> None:
        self.usable.counter = counter

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
            waiter = Waiter(uid, pod, demand, loop.create_future())
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
            return unverifiable(
                namespace,
                demand,
                f"the Kubernetes API server did not answer within {self.timeout_s:g}s",
            )
        except Unavailable as exc:
            return unverifiable(namespace, demand, str(exc))

    async def close(self) -> None:
        workers = list(self._workers.values())
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)

    async def _check(self, namespace: str, demand: Demand) -> Decision:
        """A dry run: the decision, reserving nothing."""
        quotas = await self.usable.of(namespace)
        if isinstance(quotas, Decision):
            return explain(namespace, demand, quotas)
        for quota in quotas:
            violation = self.reservations.ledger(quota).check(demand)
            if violation is not None:
                return Decision(False, self.staleness.exceeded(quota, violation), "exceeded")
        return Decision(True, reason="dry-run")

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
                        waiter.decide(unverifiable(namespace, waiter.demand, why))
                    await self.reservations.release(
                        namespace, [w for w in batch if w.denied and w.held]
                    )
        finally:
            self._workers.pop(namespace, None)

    async def _process(self, namespace: str, batch: list[Waiter]) -> None:
        quotas = await self.usable.of(namespace)
        if isinstance(quotas, Decision):
            for waiter in batch:
                waiter.decide(explain(namespace, waiter.demand, quotas))
            return

        def joined() -> list[Waiter]:
            late = self._queues.pop(namespace, [])
            batch.extend(late)
            return late

        pending = list(batch)
        for index, quota in enumerate(quotas):
            if not pending:
                break
            # Pods that arrive while the first quota's write is retried join the retry.
            pending = await self.reservations.reserve(
                namespace, quota, pending, joined if index == 0 else None
            )
        for waiter in pending:
            waiter.decide(Decision(True))
        await self.reservations.release(namespace, [w for w in batch if w.denied and w.held])
