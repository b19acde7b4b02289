"""Tells a waiting DRA pod, with an Event, why no card takes it (webhook.waiting has the words).

Runs in ``fracgpu serve`` when admission is in DRA mode. It follows Pending pods, the driver's
ResourceSlices and the ResourceClaims with informers, and every ``interval_s`` explains each pod
that kube-scheduler left Pending with "cannot allocate all claims". An Event is posted when the
explanation changes, not on every pass: capacity moves, and so does the answer, but a pod that
waits for an hour gets a handful of Events, not hundreds.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack

from core import events
from core.informer import Informer
from core.kube import PODS, RESOURCE_CLAIMS, RESOURCE_SLICES, Api, KubeError, RawBody
from webhook.waiting import REASON, Ask, asks_of, explain, free_cards, waits_for_gpu

log = logging.getLogger(__name__)

COMPONENT = "fracgpu-webhook"


class WaitExplainer:
    def __init__(self, api: Api, *, interval_s: float = 10.0) -> None:
        self.api = api
        self.interval_s = interval_s
        self.pods = Informer(
            api, PODS, field_selector="status.phase=Pending", name="dra-waiting-pods"
        )
        self.slices = Informer(api, RESOURCE_SLICES, name="dra-waiting-slices")
        self.claims = Informer(api, RESOURCE_CLAIMS, name="dra-waiting-claims")
        self._told: dict[str, str] = {}  # pod uid -> the explanation last posted

    async def run(self) -> None:
        async with AsyncExitStack() as stack:
            for informer in (self.pods, self.slices, self.claims):
                await stack.enter_async_context(informer)
            for informer in (self.pods, self.slices, self.claims):
                await informer.wait_synced()
            while True:
                try:
                    await self.explain_once()
                except (KubeError, OSError, TimeoutError) as exc:
                    log.warning("could not post a waiting pod's event", extra={"error": str(exc)})
                await asyncio.sleep(self.interval_s)

    def _asks(self, pod: RawBody) -> list[Ask]:
        namespace = str((pod.get("metadata") or {}).get("namespace") or "")
        asks: list[Ask] = []
        for entry in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
            claim = self.claims.get(str(entry.get("resourceClaimName") or ""), namespace)
            if claim is not None:
                asks.extend(asks_of(claim.get("spec") or {}))
        return asks

    async def explain_once(self) -> list[str]:
        """Post what changed; returns the messages posted (for tests and logs)."""
        free = free_cards(self.slices.objects(), self.claims.objects())
        waiting: set[str] = set()
        posted: list[str] = []
        for pod in self.pods.objects():
            meta = pod.get("metadata") or {}
            uid = str(meta.get("uid") or "")
            if not waits_for_gpu(pod):
                continue
            asks = self._asks(pod)
            if not asks:
                continue  # no claim of ours (yet)
            waiting.add(uid)
            message = explain(asks, free)
            if self._told.get(uid) == message:
                continue
            event = events.pod_event(
                namespace=str(meta.get("namespace") or ""),
                pod=str(meta.get("name") or ""),
                uid=uid,
                reason=REASON,
                message=message,
                component=COMPONENT,
            )
            await events.post(self.api, event)
            self._told[uid] = message
            posted.append(message)
        for uid in set(self._told) - waiting:
            del self._told[uid]
        return posted
