"""Which GPUQuotas of a namespace a decision uses, or the decision for every pod when none can be.

A namespace without GPUQuotas allows GPU pods (denies them with ``require_quota``); without the
CRD, or with a quota that cannot be read, it denies them. With a usage controller (Kubernetes
mode) a quota it has not counted yet (new, spec changed, status reset) is not used: its pods
wait a moment for the count, and are denied with a message that says so, as Kubernetes'
ResourceQuota does, if it does not come.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from quota import messages
from quota.decision import Decision
from quota.model import GPUQuota, QuotaError
from quota.store import NotFound, QuotaStore, Unavailable

log = logging.getLogger(__name__)

# Counts a quota from the pods, when no controller has (:meth:`UsageController.count`).
QuotaCounter = Callable[[Mapping[str, Any]], Awaitable[None]]

# How often a quota read live is read again while its pods wait for it to be counted.
_POLL_S = 0.05


class UsableQuotas:
    def __init__(
        self,
        store: QuotaStore,
        *,
        require_quota: bool = False,
        controller: bool = True,
        count_wait_s: float = 2.0,
        counter: QuotaCounter | None = None,
        handover_s: float = 0.3,
    ) -> None:
        """See :class:`quota.reserver.Reserver` for what each setting means."""
        self.store = store
        self.require_quota = require_quota
        self.controller = controller
        self.count_wait_s = count_wait_s
        self.counter = counter
        self.handover_s = min(handover_s, count_wait_s / 2)

    async def of(self, namespace: str) -> list[GPUQuota] | Decision:
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
                    fresh = await self.counted(namespace, quota.name)
                except NotFound:
                    continue  # deleted meanwhile: it limits nothing any more
                except QuotaError as exc:
                    return Decision(False, str(exc), "invalid-quota")
                if not fresh.counted():
                    return Decision(False, messages.not_counted(fresh), "not-counted")
                quotas[index] = fresh
        return quotas

    async def counted(self, namespace: str, name: str) -> GPUQuota:
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
            await asyncio.sleep(_POLL_S)
