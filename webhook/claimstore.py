"""DRA mode's side effects at admission: the claim templates exist, and unused ones go away.

Kept apart from :mod:`webhook.claims` so that ``fracgpu review`` never imports the Kubernetes
client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from core.informer import EventType, Informer, Informers
from core.kube import (
    CRONJOBS,
    DAEMONSETS,
    DEPLOYMENTS,
    JOBS,
    PODS,
    REPLICASETS,
    RESOURCE_CLAIM_TEMPLATES,
    RESOURCE_SLICES,
    STATEFULSETS,
    Api,
    KubeConflict,
    KubeError,
    KubeNotFound,
    RawBody,
    Resource,
    call_json,
)
from core.units import DOMAIN
from webhook.claims import TEMPLATE_LABELS, ClaimPlan, SliceModels, TemplateError

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
    _planned: dict[tuple[str, str], Mapping[str, Any]] = field(default_factory=dict)

    async def ensure(self, namespace: str, plan: ClaimPlan, *, dry_run: bool) -> None:
        self._remember(namespace, plan)
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
            try:
                path = RESOURCE_CLAIM_TEMPLATES.path(namespace)
                await call_json(self.api, "POST", path, body=body)
            except KubeConflict:
                await self._touch(namespace, plan.name, now)
        except (KubeError, OSError, TimeoutError) as exc:
            raise TemplateError(
                f"could not create the ResourceClaimTemplate {namespace}/{plan.name} that this "
                f"pod's GPU claim is made from ({exc}); create the pod again, and tell the "
                f"cluster operator if this persists (the webhook needs create and patch on "
                f"resourceclaimtemplates)"
            ) from None
        if len(self._known) >= 4096:
            self._known.clear()
        self._known[key] = now

    def _remember(self, namespace: str, plan: ClaimPlan) -> None:
        if len(self._planned) >= 4096:
            self._planned.clear()
        self._planned[namespace, plan.name] = plan.template["spec"]["spec"]

    def planned(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The claim spec of a template this replica planned, made or not (a dry run makes
        none): quota, in the same process, counts a dry-run pod's claims from it."""
        return self._planned.get((namespace, name))

    async def _touch(self, namespace: str, name: str, now: float) -> None:
        patch = {"metadata": {"annotations": {LAST_USED_ANNOTATION: str(int(now))}}}
        await call_json(
            self.api,
            "PATCH",
            RESOURCE_CLAIM_TEMPLATES.path(namespace, name),
            body=patch,
            content_type="application/merge-patch+json",
        )

    async def collect(self, referenced: Mapping[str, set[str]]) -> list[str]:
        """Delete unused managed templates (``referenced``: template names in use, by
        namespace); returns ``namespace/name`` of each one deleted."""
        now = self.clock()
        deleted: list[str] = []
        for template in await self.managed():
            meta = template.get("metadata") or {}
            namespace, name = str(meta.get("namespace")), str(meta.get("name"))
            last = (meta.get("annotations") or {}).get(LAST_USED_ANNOTATION, "0")
            idle = now - float(last) if last.isdigit() else float("inf")
            if name in referenced.get(namespace, set()) or idle < self.grace_s:
                continue
            try:
                await call_json(self.api, "DELETE", RESOURCE_CLAIM_TEMPLATES.path(namespace, name))
            except KubeNotFound:
                continue
            self._known.pop((namespace, name), None)
            deleted.append(f"{namespace}/{name}")
            log.info("deleted an unused claim template", extra={"template": deleted[-1]})
        return deleted

    async def managed(self) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in TEMPLATE_LABELS.items())
        listing = await call_json(
            self.api,
            "GET",
            RESOURCE_CLAIM_TEMPLATES.path(None),
            query=[("labelSelector", selector)],
        )
        items: list[dict[str, Any]] = listing.get("items") or []
        return items

    async def collect_forever(self, interval_s: float = 300.0) -> None:
        """Collect every ``interval_s``; a failed pass is logged and tried again later."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                namespaces = {
                    str((t.get("metadata") or {}).get("namespace")) for t in await self.managed()
                }
                referenced = {ns: await referenced_templates(self.api, ns) for ns in namespaces}
                await self.collect(referenced)
            except (KubeError, OSError, TimeoutError) as exc:
                log.warning("claim template collection failed", extra={"error": str(exc)})


# Where pod templates live: pods, and every built-in workload that makes pods.
_WORKLOADS: tuple[tuple[Resource, tuple[str, ...]], ...] = (
    (PODS, ()),
    (DEPLOYMENTS, ("spec", "template")),
    (REPLICASETS, ("spec", "template")),
    (STATEFULSETS, ("spec", "template")),
    (DAEMONSETS, ("spec", "template")),
    (JOBS, ("spec", "template")),
    (CRONJOBS, ("spec", "jobTemplate", "spec", "template")),
)


async def referenced_templates(api: Api, namespace: str) -> set[str]:
    """Claim template names that a pod, or a workload that will make pods, names in
    ``namespace``: a Deployment scaled to zero still needs its template when it scales up."""
    names: set[str] = set()
    for resource, path in _WORKLOADS:
        listing = await call_json(api, "GET", resource.path(namespace))
        for item in listing.get("items") or []:
            template: Any = item
            for token in path:
                template = template.get(token) if isinstance(template, dict) else None
            spec = template.get("spec") if isinstance(template, dict) else None
            claims = spec.get("resourceClaims") if isinstance(spec, dict) else None
            for claim in claims if isinstance(claims, list) else ():
                if isinstance(claim, dict) and claim.get("resourceClaimTemplateName"):
                    names.add(str(claim["resourceClaimTemplateName"]))
    return names


def slice_informer(api: Api, models: SliceModels, informers: Informers | None = None) -> Informer:
    """An informer on ResourceSlices whose events keep ``models`` current."""

    def on_event(kind: EventType, obj: RawBody) -> None:
        name = str((obj.get("metadata") or {}).get("name") or "")
        if kind == "DELETED":
            models.remove_slice(name)
        else:
            models.set_slice(name, obj.get("spec") or {})

    informer = (informers or Informers(api)).of(RESOURCE_SLICES)
    informer.add_handler(on_event)
    return informer
