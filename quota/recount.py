"""The recount: one GPUQuota's ``status.used`` computed again from the pods that exist.

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

The recount only computes the new status; :mod:`quota.countwriter` writes it. docs/quota.md
gives the whole argument, including the grace it relies on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from quota.claims import ClaimSpecs, claim_refs
from quota.demand import CardMemory, Demand, is_terminal, pod_demand
from quota.ledger import DEFAULT_PENDING_LIMIT, Ledger, Pending, Scoped
from quota.livepods import LivePods
from quota.metrics import QuotaMetrics
from quota.model import (
    CONTROLLER_ACTIVE,
    COUNTED,
    Condition,
    GPUQuota,
    QuotaStatus,
    now,
)
from quota.pacing import Pacing

log = logging.getLogger(__name__)

# The pods of a namespace as the watch cache holds them.
PodCache = Callable[[str], Sequence[Mapping[str, Any]]]


def _uid(pod: Mapping[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("uid") or "")


def counted_status(
    quota: GPUQuota, ledger: Ledger, *, counted: int, pending: int, at: datetime, active: bool
) -> QuotaStatus:
    """The status a recount leaves: the ledger's, said to be counted (and, when ``active``,
    that the controller matches admissions: the one recounting is it)."""
    status = ledger.status(quota.status).with_condition(
        Condition(
            type=COUNTED,
            status="True",
            reason="Counted",
            message=f"{counted} GPU pods counted, {pending} admissions pending",
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
    return status.model_copy(update={"observed_generation": quota.generation})


class Recounter:
    """Recounts quotas; remembers, per quota UID, what the next recount needs of this one."""

    def __init__(
        self,
        cache: PodCache,
        live: LivePods,
        pacing: Pacing,
        metrics: QuotaMetrics,
        *,
        demands: Mapping[str, Demand | None],
        deleted: Container[str],
        grace: timedelta,
        pending_limit: int = DEFAULT_PENDING_LIMIT,
        clock: Callable[[], datetime] = now,
        card_memory: CardMemory | None = None,
        claims: ClaimSpecs | None = None,
    ) -> None:
        """``demands`` and ``deleted``: what the watch said of pods (:mod:`quota.intake`)."""
        self.cache = cache
        self.live = live
        self.pacing = pacing
        self.metrics = metrics
        self.demands = demands
        self.deleted = deleted
        self.grace = grace
        self.pending_limit = pending_limit
        self.clock = clock
        self.card_memory = card_memory
        self.claims = claims
        # The pods counted in the last status written (None until the first write: then it
        # cannot tell which pods are new, and subtracts nothing from ``unmatched``).
        self.accounted: dict[str, set[str]] = {}
        # Admissions dropped as expired, should their pod appear after all.
        self.expired: dict[str, set[str]] = {}

    def settled(self, quota_uid: str, live: set[str]) -> None:
        """What is persisted for this quota now counts ``live``."""
        self.accounted[quota_uid] = live

    def forget(self, quota_uid: str) -> None:
        self.accounted.pop(quota_uid, None)
        self.expired.pop(quota_uid, None)

    async def recount(
        self, quota: GPUQuota, *, fresh: bool = False, active: bool = True
    ) -> tuple[GPUQuota | None, set[str]]:
        """The quota with its recounted status (None when nothing changed) and the pods it
        counted. ``fresh``: from a live list of pods, never the cache; ``active``: say in the
        status that the controller matches admissions (it is this one)."""
        at = self.clock()
        ledger = Ledger.of(quota, pending_limit=self.pending_limit)
        pods, known = await self._pods(quota.namespace, ledger, at, fresh=fresh)
        live, ended = self._classify(pods, known, at)
        expired = self.expired.setdefault(quota.uid, set())
        released, keep = await self._match(quota.namespace, ledger, live, ended, at)
        unmatched = self._unmatched(quota, ledger, live, at, released)
        ledger.recount(live, keep, unmatched)
        self.pacing.schedule(quota.namespace, ledger)
        status = counted_status(
            quota, ledger, counted=len(live), pending=len(keep), at=at, active=active
        )
        if quota.with_status(status).raw.get("status") == quota.raw.get("status"):
            return None, set(live)
        candidate = quota.with_status(status.model_copy(update={"last_reconcile_time": at}))
        for uid, why in released.items():
            self.metrics.released.labels(why).inc()
            if why == "expired":
                expired.add(uid)
            log.debug("admission released", extra={"uid": uid, "why": why})
        return candidate, set(live)

    async def _pods(
        self, namespace: str, ledger: Ledger, at: datetime, *, fresh: bool
    ) -> tuple[Sequence[Mapping[str, Any]], Mapping[str, Demand | None]]:
        """The namespace's pods, and the demands already known of them, claims read."""
        newest = ledger.unmatched_newest
        if fresh or (not ledger.unmatched.empty and (newest is None or at - newest > self.grace)):
            # `unmatched` is about to be dropped whole: its pods must then be counted as pods,
            # so count from a live list, not from a cache that may lag.
            pods: Sequence[Mapping[str, Any]] = await self.live.read(namespace)
            known: Mapping[str, Demand | None] = {}
        else:
            pods, known = self.cache(namespace), self.demands
        if self.claims is not None:
            # Only pods whose demand is not known yet: the others' claims were read already.
            await self.claims.load(
                ref for pod in pods if _uid(pod) not in known for ref in claim_refs(pod)
            )
        return pods, known

    def _classify(
        self,
        pods: Sequence[Mapping[str, Any]],
        known: Mapping[str, Demand | None],
        at: datetime,
    ) -> tuple[dict[str, Demand], set[str]]:
        """The GPU pods that hold quota (by UID, with their demand), and those that ended."""
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
        return live, ended

    async def _match(
        self,
        namespace: str,
        ledger: Ledger,
        live: Mapping[str, Demand],
        ended: set[str],
        at: datetime,
    ) -> tuple[dict[str, str], list[Pending]]:
        """The pending admissions released (by UID: why), and those kept."""
        released: dict[str, str] = {}
        keep: list[Pending] = []
        for entry in ledger.pending:
            if entry.uid in live:
                released[entry.uid] = "confirmed"
            elif entry.uid in ended or entry.uid in self.deleted:
                released[entry.uid] = "ended"
            elif at - entry.at > self.grace and not await self.live.exists(
                namespace, entry.pod, entry.uid
            ):
                released[entry.uid] = "expired"
            else:
                keep.append(entry)
        return released, keep

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
        accounted = self.accounted.get(quota.uid)
        if accounted is None:
            return unmatched  # cannot tell which pods are new: keep it all until it is due
        pending = {entry.uid for entry in ledger.pending}
        skip = accounted | pending | self.expired.get(quota.uid, set())
        for uid, demand in live.items():
            if uid not in skip:
                unmatched.remove(demand, ledger.spec)
        return unmatched
