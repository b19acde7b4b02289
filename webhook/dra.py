"""Admission in DRA mode: the request language turned into ResourceClaimTemplates.

In DRA mode (design §9) a GPU container does not carry extended resources; it holds one
ResourceClaim made from a template in the pod's namespace, and the stock scheduler places the
claim on a card whose ``cores`` and ``memory`` capacities can hold it. This module decides what
that template says; ``TemplateStore`` makes sure it exists.

The templates are shared: one per *shape* (``0.3`` card with 8 GiB is one shape, two whole cards
another), named from the shape, so a Deployment of a hundred replicas uses one template and the
resourceclaim controller gives each pod its own claim, owned by the pod. A webhook cannot create
the claims itself: at admission the pod has no UID to own them, and an unowned claim outlives
its pod.

How each request becomes a device request:

* whole cards (``fracgpu.io/gpu: 2``): ``count: 2`` and no capacity. The slice's capacity
  defaults are the whole card, so each card is taken whole, whatever its model: admission needs
  no model knowledge.
* a share with its memory given (``0.3`` and ``8Gi``): ``count: 1`` with ``cores: 30`` and
  ``memory: 8192Mi``.
* a share whose other half depends on the card (a fraction without memory, a percentage,
  memory without a fraction): ``firstAvailable``, one alternative per GPU model the cluster's
  ResourceSlices show, each selecting its model by CEL and sized for it with the same defaults
  as device-plugin mode (``webhook.resources``), so a percentage is of the card the pod really
  gets.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from core import dra
from core.kube import RESOURCE_CLAIM_TEMPLATES, Api, KubeConflict, KubeNotFound, call_json
from core.units import (
    BLOCK_MIB,
    CORE_PER_CARD,
    DOMAIN,
    ENV_GPU,
    ENV_MEMORY_MIB,
    ceil_div,
    format_cards,
)
from webhook.resources import Card, CardChoice, RequestError, _Ask, _resolve, container_ref

log = logging.getLogger(__name__)

TEMPLATE_PREFIX = "fracgpu-"
MANAGED_LABEL = "app.kubernetes.io/managed-by"
MANAGED_VALUE = "fracgpu"
LAST_USED_ANNOTATION = f"{DOMAIN}/last-used"
REQUEST_NAME = "gpu"


@dataclass(frozen=True, slots=True)
class ClaimPlan:
    """The template a container's claim is made from, and what the container is told."""

    template: dict[str, Any]
    env: dict[str, str]
    warnings: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return str(self.template["metadata"]["name"])


def plan_claim(container: str, ask: _Ask, models: Mapping[str, Card]) -> ClaimPlan:
    """The claim template for one container's request; RequestError names what is wrong."""
    warnings: list[str] = []
    core = ask.core
    if core is not None and core >= CORE_PER_CARD:
        cards = core // CORE_PER_CARD
        request = {"deviceClassName": dra.DEVICE_CLASS, "count": cards}
        return _plan(f"cards-{cards}", {"exactly": request}, {ENV_GPU: str(cards)}, [])
    blocks = ask.memory_blocks
    if ask.memory_mib is not None:
        blocks = ceil_div(ask.memory_mib, BLOCK_MIB)
        if blocks * BLOCK_MIB != ask.memory_mib:
            warnings.append(
                f"{container_ref(container)}: {ask.memory_mib} MiB of GPU memory rounded up to "
                f"{blocks * BLOCK_MIB} MiB (GPU memory is granted in {BLOCK_MIB} MiB blocks)"
            )
    if core is not None and blocks is not None:
        request = _share_request(core, blocks)
        env = {ENV_GPU: format_cards(core), ENV_MEMORY_MIB: str(blocks * BLOCK_MIB)}
        return _plan(f"c{core}-m{blocks * BLOCK_MIB}", {"exactly": request}, env, warnings)
    alternatives = _per_model(container, ask, models)
    shape = "-".join(
        part
        for part in (
            f"c{core}" if core is not None else "",
            f"m{blocks * BLOCK_MIB}" if blocks is not None else "",
            f"p{ask.memory_percent}" if ask.memory_percent is not None else "",
        )
        if part
    )
    digest = hashlib.sha256(json.dumps(alternatives, sort_keys=True).encode()).hexdigest()[:10]
    env = {ENV_GPU: format_cards(core)} if core is not None else {}
    return _plan(f"{shape}-{digest}", {"firstAvailable": alternatives}, env, warnings)


def _per_model(container: str, ask: _Ask, models: Mapping[str, Card]) -> list[dict[str, Any]]:
    """One alternative per known model, smallest card first, sized by the device-plugin rules."""
    if not models:
        raise RequestError(
            f"{container_ref(container)}: cannot size this request: no GPU models are published "
            f"in the cluster's ResourceSlices yet; give both fracgpu.io/gpu and fracgpu.io/gpumem "
            f"(for example 0.5 and 8Gi), or ask for whole cards"
        )
    ordered = sorted(models.values(), key=lambda card: (card.memory_mib, card.product))
    alternatives: list[dict[str, Any]] = []
    too_small: list[Card] = []
    for card in ordered:
        try:
            grant = _resolve(container, ask, CardChoice(card, card), [])
        except RequestError:
            too_small.append(card)
            continue
        request = _share_request(grant.core, grant.memory_blocks)
        request["selectors"] = [{"cel": {"expression": dra.product_selector(card.product)}}]
        alternatives.append({"name": f"m{len(alternatives)}", **request})
    if not alternatives:
        largest = ordered[-1]
        raise RequestError(
            f"{container_ref(container)}: asks for more GPU memory than any card has (the largest, "
            f"{largest.product}, has {largest.memory_mib} MiB); ask for less memory, or for "
            f"whole cards"
        )
    if len(alternatives) > dra.MAX_SUBREQUESTS:
        raise RequestError(
            f"{container_ref(container)}: the cluster has {len(alternatives)} GPU models and a "
            f"claim can offer at most {dra.MAX_SUBREQUESTS} alternatives; give both "
            f"fracgpu.io/gpu and fracgpu.io/gpumem so that the request fits any card"
        )
    return alternatives


def _share_request(core: int, blocks: int) -> dict[str, Any]:
    return {
        "deviceClassName": dra.DEVICE_CLASS,
        "count": 1,
        "capacity": {"requests": {dra.CORES: str(core), dra.MEMORY: dra.memory_quantity(blocks)}},
    }


def _plan(
    shape: str, request: dict[str, Any], env: dict[str, str], warnings: list[str]
) -> ClaimPlan:
    template = {
        "apiVersion": dra.API_VERSION,
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": f"{TEMPLATE_PREFIX}{shape}",
            "labels": {MANAGED_LABEL: MANAGED_VALUE},
        },
        "spec": {"spec": {"devices": {"requests": [{"name": REQUEST_NAME, **request}]}}},
    }
    return ClaimPlan(template, env, tuple(warnings))


def pod_claim_name(container_kind: str, index: int) -> str:
    """The pod-level claim entry of one GPU container: a DNS label, unique in the pod."""
    prefix = "gpu-init" if container_kind == "initContainers" else "gpu"
    return f"{prefix}-{index}"


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
            query=[("labelSelector", f"{MANAGED_LABEL}={MANAGED_VALUE}")],
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
