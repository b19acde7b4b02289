"""DRA mode's side effects at admission: the claim templates exist, and unused ones go away.

Kept apart from :mod:`webhook.claims` so that ``fracgpu review`` never imports the Kubernetes
client.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from core.kube import (
    RESOURCE_CLAIM_TEMPLATES,
    RESOURCE_SLICES,
    Api,
    EventType,
    Informer,
    KubeConflict,
    KubeNotFound,
    RawBody,
    call_json,
)
from core.units import DOMAIN
from webhook.claims import TEMPLATE_LABELS, ClaimPlan, SliceModels

log = logging.getLogger(__name__)

LAST_USED_ANNOTATION = f"{DOMAIN}/last-used"


@dataclass
class TemplateStore:
    """Makes sure the templates admission names exist, and deletes those no pod uses.

    ``ensure`` is on the admission path, so it remembers what it created or found (bounded)
    and refreshes a template's last-used annotation at most once per ``touch_interval_s``.
    ``collect`` deletes a managed template that no pod in its namespace references and that was
    last used longer ago than ``grace_s``: a pod is created within seconds of its admission, so
    a template in use by a pod being admitted is never older than that.
    """

    api: Api
    grace_s: float = 600.0
    touch_interval_s: float = 60.0
    clock: Callable[[], float] = time.time
    _known: dict[tuple[str, str], float] = field(default_factory=dict)

    async def ensure(self, namespace: str, plan: ClaimPlan, *, dry_run: bool) -> None:
        if dry_run:
            return  # sideEffects: NoneOnDryRun
        key = (namespace, plan.name)
        now = self.clock()
        seen = self._known.get(key)
        if seen is not None and now - seen < self.touch_interval_s:
            return
        body = json.loads(json.dumps(plan.template))
        body["metadata"]["namespace"] = namespace
        body["metadata"]["annotations"] = {LAST_USED_ANNOTATION: str(int(now))}
        try:
            await call_json(self.api, "POST", RESOURCE_CLAIM_TEMPLATES.path(namespace), body=body)
        except KubeConflict:
            await self._touch(namespace, plan.name, now)
        if len(self._known) >= 4096:
            self._known.clear()
        self._known[key] = now

    async def _touch(self, namespace: str, name: str, now: float) -> None:
        patch = {"metadata": {"annotations": {LAST_USED_ANNOTATION: str(int(now))}}}
        await call_json(
            self.api,
            "PATCH",
            RESOURCE_CLAIM_TEMPLATES.path(namespace, name),
            body=patch,
            content_type="application/merge-patch+json",
        )

    async def collect(self, pods_by_namespace: Mapping[str, list[Mapping[str, Any]]]) -> list[str]:
        """Delete unused managed templates; returns ``namespace/name`` of each one deleted."""
        listing = await call_json(
            self.api,
            "GET",
            RESOURCE_CLAIM_TEMPLATES.path(None),
            query=[("labelSelector", ",".join(f"{k}={v}" for k, v in TEMPLATE_LABELS.items()))],
        )
        now = self.clock()
        deleted: list[str] = []
        for template in listing.get("items") or []:
            meta = template.get("metadata") or {}
            namespace, name = str(meta.get("namespace")), str(meta.get("name"))
            used = {
                str(claim.get("resourceClaimTemplateName"))
                for pod in pods_by_namespace.get(namespace, [])
                for claim in (pod.get("spec") or {}).get("resourceClaims") or []
            }
            last = (meta.get("annotations") or {}).get(LAST_USED_ANNOTATION, "0")
            idle = now - float(last) if last.isdigit() else float("inf")
            if name in used or idle < self.grace_s:
                continue
            try:
                await call_json(self.api, "DELETE", RESOURCE_CLAIM_TEMPLATES.path(namespace, name))
            except KubeNotFound:
                continue
            self._known.pop((namespace, name), None)
            deleted.append(f"{namespace}/{name}")
            log.info("deleted an unused claim template", extra={"template": deleted[-1]})
        return deleted


def slice_informer(api: Api, models: SliceModels) -> Informer:
    """An informer on ResourceSlices whose events keep ``models`` current."""

    def on_event(kind: EventType, obj: RawBody) -> None:
        name = str((obj.get("metadata") or {}).get("name") or "")
        if kind == "DELETED":
            models.remove_slice(name)
        else:
            models.set_slice(name, obj.get("spec") or {})

    return Informer(api, RESOURCE_SLICES, handler=on_event, name="dra-models")
