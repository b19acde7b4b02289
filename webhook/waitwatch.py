"""Tells a waiting GPU pod, with an Event, why no card takes it (webhook.waiting has the words).

Runs in ``fracgpu serve`` in both modes, on one replica: the one leading the quota controller's
Lease (each replica posting its own Event doubled every Event). It reads pods from the informer
the quota controller shares, picks the Pending ones and, every
``interval_s``, explains each pod that kube-scheduler left Pending because no card fits: in DRA
mode "cannot allocate all claims", over the driver's ResourceSlices and the ResourceClaims; in
device-plugin mode "Insufficient fracgpu.io/...", over what each node's plugin publishes free
per card on its Node. Given the scheduler admission hands GPU pods to and what says whether it
runs (its Lease, ``webhook.schedwatch``), it also tells a GPU pod left to that scheduler while it
is down, on which no scheduler writes a word (with extender placement admission hands pods over
even then). An Event is posted when the explanation changes, not on every pass:
capacity moves, and so does the answer, but a pod that waits for an hour gets a handful of
Events, not hundreds.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack
from typing import Protocol

from core import events
from core.informer import Informer, Informers
from core.kube import NODES, PODS, RESOURCE_CLAIMS, RESOURCE_SLICES, Api, KubeError, RawBody
from webhook.waiting import (
    REASON,
    SCHEDULER_DOWN,
    CardNeed,
    FreeCard,
    asks_of,
    asks_of_pod,
    explain,
    free_cards,
    free_cards_of_nodes,
    scheduler_down,
    unscheduled_by,
    waits_for_gpu,
    waits_for_share,
)

log = logging.getLogger(__name__)

COMPONENT = "fracgpu-webhook"


class SchedulerCheck(Protocol):
    """Says why the scheduler is not running (None: it is); ``webhook.schedwatch``'s
    SchedulerPresence."""

    def not_running(self) -> str | None: ...


class WaitExplainer:
    def __init__(
        self,
        api: Api,
        *,
        interval_s: float = 10.0,
        device_plugin: bool = False,
        informers: Informers | None = None,
        scheduler: tuple[str, SchedulerCheck] | None = None,
    ) -> None:
        """``informers``: the process's shared ones. It reads every pod (and picks the Pending
        ones), as the quota controller beside it does: one watch for both. ``scheduler``: the
        name admission sets on GPU pods, and what says whether it runs."""
        self.api = api
        self.scheduler = scheduler
        self.interval_s = interval_s
        self.device_plugin = device_plugin
        informers = informers or Informers(api)
        self.pods = informers.of(PODS)
        self.slices = informers.of(RESOURCE_SLICES)
        self.claims = informers.of(RESOURCE_CLAIMS)
        self.nodes = informers.of(NODES)
        self._told: dict[str, str] = {}  # pod uid -> the explanation last posted

    def _informers(self) -> tuple[Informer, ...]:
        if self.device_plugin:
            return (self.pods, self.nodes)
        return (self.pods, self.slices, self.claims)

    async def run(self) -> None:
        async with AsyncExitStack() as stack:
            for informer in self._informers():
                await stack.enter_async_context(informer)
            for informer in self._informers():
                await informer.wait_synced()
            while True:
                try:
                    await self.explain_once()
                except (KubeError, OSError, TimeoutError) as exc:
                    log.warning("could not post a waiting pod's event", extra={"error": str(exc)})
                await asyncio.sleep(self.interval_s)

    def _free(self) -> list[FreeCard]:
        if self.device_plugin:
            return free_cards_of_nodes(self.nodes.objects())
        return free_cards(self.slices.objects(), self.claims.objects())

    def _waits(self, pod: RawBody) -> bool:
        return waits_for_share(pod) if self.device_plugin else waits_for_gpu(pod)

    def _asks(self, pod: RawBody) -> list[CardNeed]:
        if self.device_plugin:
            return asks_of_pod(pod)
        namespace = str((pod.get("metadata") or {}).get("namespace") or "")
        asks: list[CardNeed] = []
        for entry in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
            claim = self.claims.get(str(entry.get("resourceClaimName") or ""), namespace)
            if claim is not None:
                asks.extend(asks_of(claim.get("spec") or {}))
        return asks

    async def explain_once(self) -> list[str]:
        """Post what changed; returns the messages posted (for tests and logs)."""
        free = self._free()
        down = self._scheduler_down()
        waiting: set[str] = set()
        posted: list[str] = []
        for pod in self.pods.objects():
            meta = pod.get("metadata") or {}
            uid = str(meta.get("uid") or "")
            unscheduled = down is not None and unscheduled_by(pod, down[0])
            if not (unscheduled or self._waits(pod)):
                continue
            asks = self._asks(pod)
            if not asks:
                continue  # no claim of ours (yet)
            waiting.add(uid)
            if unscheduled and down is not None:
                reason, message = SCHEDULER_DOWN, scheduler_down(*down)
            else:
                reason, message = REASON, explain(asks, free, device_plugin=self.device_plugin)
            if self._told.get(uid) == message:
                continue
            event = events.pod_event(
                namespace=str(meta.get("namespace") or ""),
                pod=str(meta.get("name") or ""),
                uid=uid,
                reason=reason,
                message=message,
                component=COMPONENT,
            )
            await events.post(self.api, event)
            self._told[uid] = message
            posted.append(message)
        for uid in set(self._told) - waiting:
            del self._told[uid]
        return posted

    def _scheduler_down(self) -> tuple[str, str] | None:
        """(name, why) of the scheduler GPU pods are handed to, while it is not running."""
        if self.scheduler is None:
            return None
        name, check = self.scheduler
        why = check.not_running()
        return None if why is None else (name, why)
