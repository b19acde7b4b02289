"""Writing a recounted GPUQuota status: a compare-and-swap on the version read, retried.

The write never erases an admission written meanwhile: on 409 the writer re-reads the quota and
recounts it (:mod:`quota.recount`). A pod is therefore charged at least once from its admission
until it ends: usage may be over-counted for a moment, never under. Two callers: the usage
controller's passes (:meth:`CountWriter.reconcile`, which tries hard: it is off the pod-create
path) and a replica counting a quota nobody has counted yet (:meth:`CountWriter.count`, once).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping
from typing import Any

from quota.ledger import Ledger
from quota.metrics import QuotaMetrics
from quota.model import GPUQuota, QuotaError
from quota.recount import Recounter
from quota.store import Conflict, QuotaStore

log = logging.getLogger(__name__)

# A first count gives up after this many conflicts: whoever won wrote a count too.
_COUNT_ATTEMPTS = 3


def readable(obj: dict[str, Any]) -> GPUQuota | None:
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


class CountWriter:
    def __init__(
        self,
        store: QuotaStore,
        recounter: Recounter,
        metrics: QuotaMetrics,
        *,
        max_attempts: int = 20,
    ) -> None:
        self.store = store
        self.recounter = recounter
        self.metrics = metrics
        self.max_attempts = max_attempts

    async def reconcile(self, raw: Mapping[str, Any]) -> None:
        """Recount one GPUQuota and drop the admissions it no longer needs to hold."""
        obj = dict(raw)
        # The controller is off the pod-create path: it may try harder than admission to win
        # its write against a burst of admissions.
        attempt = 0
        for _ in range(self.max_attempts * 4):
            quota = readable(obj)
            if quota is None:
                return
            candidate, live = await self.recounter.recount(quota)
            if candidate is None:
                # What is persisted is what a write would have said: the same pods counted.
                self.recounter.settled(quota.uid, live)
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
            self.recounter.settled(quota.uid, live)
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
        Raises :class:`quota.store.Unavailable` when the API server cannot be reached."""
        obj = dict(raw)
        for _ in range(_COUNT_ATTEMPTS):
            quota = readable(obj)
            if quota is None or quota.counted():
                return
            candidate, live = await self.recounter.recount(quota, fresh=True, active=False)
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
