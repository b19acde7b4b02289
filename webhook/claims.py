"""Admission in DRA mode: the request language turned into ResourceClaimTemplates.

In DRA mode (design §9) a GPU container does not carry extended resources; it holds one
ResourceClaim made from a template in the pod's namespace, and the stock scheduler places the
claim on a card whose ``cores`` and ``memory`` capacities can hold it. This module decides what
that template says, without talking to the cluster (``fracgpu review`` uses it too);
``webhook.claimstore`` makes sure the template exists.

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
  as device-plugin mode (``webhook.sizing``), so a percentage is of the card the pod really
  gets.
* a share of several cards (``fracgpu.io/gpu: 0.3``, ``fracgpu.io/gpu-count: 2``; HAMi's
  ``nvidia.com/gpu: 2`` with a share): the same request with ``count: 2``. The devices of one
  request are always distinct cards, on the one node the pod runs on, and each is charged the
  capacity; the node agent writes one limits file naming both cards with the share of each.

A pod that chose its GPU models (``fracgpu.io/gpu-model``, ``-exclude``) gets alternatives only
for those models, and ``exactly`` requests select them by CEL on the card's ``productName``. The
choice is part of the template's name (a digest), so pods with different choices never share a
template.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Any

from core import dra
from core.labels import ModelSet
from core.policy import Priority, SharePolicy
from core.quantity import QuantityError, parse_quantity
from core.units import (
    BLOCK_MIB,
    CORE_PER_CARD,
    MIB,
)
from webhook.gpumodels import CardChoice, GpuModel
from webhook.parsing import ContainerAsk, RequestError
from webhook.sizing import resolve
from webhook.wording import container_ref

log = logging.getLogger(__name__)

TEMPLATE_PREFIX = dra.TEMPLATE_PREFIX
TEMPLATE_LABELS = {"app.kubernetes.io/managed-by": "fracgpu"}
REQUEST_NAME = "gpu"


@dataclass(frozen=True, slots=True)
class ClaimPlan:
    """The template a container's claim is made from, and what its sizing warned about."""

    template: dict[str, Any]
    warnings: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return str(self.template["metadata"]["name"])


def plan_claim(
    container: str,
    ask: ContainerAsk,
    models: Mapping[str, GpuModel],
    *,
    max_cards: int,
    chosen: ModelSet | None = None,
) -> ClaimPlan:
    """The claim template for one container's request; RequestError names what is wrong.

    Whole cards and shares whose memory is given go through the same rules as device-plugin
    mode (``webhook.sizing``: the bound on whole cards, memory rounded up to blocks with a
    warning, memory no known card has refused); the rest is sized once per model. ``models``
    are those the pod may get; ``chosen``, the pod's own choice, if it made one.
    """
    warnings: list[str] = []
    selector = dra.products_selector(chosen.only, chosen.excluded) if chosen else None
    # The choice names the template too: a short digest of the selector, after the shape.
    mark = ""
    if selector is not None:
        mark = "-g" + hashlib.sha256(selector.encode()).hexdigest()[:10]
    every = CardChoice(tuple(sorted(models.values(), key=lambda c: (c.memory_mib, c.product))))
    core = ask.core
    if core is not None and (
        core >= CORE_PER_CARD or ask.memory_mib is not None or ask.memory_blocks is not None
    ):
        grant = resolve(container, ask, every, max_cards, warnings)
        if grant.whole_cards:
            request = {"deviceClassName": dra.DEVICE_CLASS, "count": grant.whole_cards}
            shape = f"cards-{grant.whole_cards}{mark}"
        else:
            mib = grant.memory_blocks * BLOCK_MIB
            request = _share_request(grant.core, grant.memory_blocks, ask.count)
            shape = f"c{grant.core}-m{mib}{_cards_part(ask)}{mark}"
        if selector is not None:
            request["selectors"] = [{"cel": {"expression": selector}}]
        return _plan(shape, {"exactly": request}, warnings)
    alternatives = _per_model(container, ask, every.cards)
    shape = "-".join(
        part
        for part in (
            f"c{core}" if core is not None else "",
            f"m{ask.memory_mib}" if ask.memory_mib is not None else "",
            f"p{ask.memory_percent}" if ask.memory_percent is not None else "",
            _cards_part(ask)[1:],
        )
        if part
    )
    hashed: object = alternatives if selector is None else [alternatives, selector]
    digest = hashlib.sha256(json.dumps(hashed, sort_keys=True).encode()).hexdigest()[:10]
    # "h" marks the digest: the name says which part is the shape and which part is not.
    return _plan(f"{shape}-h{digest}", {"firstAvailable": alternatives}, warnings)


def _per_model(
    container: str, ask: ContainerAsk, ordered: tuple[GpuModel, ...]
) -> list[dict[str, Any]]:
    """One alternative per known model, smallest card first, sized by the device-plugin rules."""
    if not ordered:
        raise RequestError(
            f"{container_ref(container)}: cannot size this request: no GPU models are published "
            f"in the cluster's ResourceSlices yet; give both fracgpu.io/gpu and fracgpu.io/gpumem "
            f"(for example 0.5 and 8Gi), or ask for whole cards"
        )
    alternatives: list[dict[str, Any]] = []
    too_small: list[GpuModel] = []
    for card in ordered:
        try:
            grant = resolve(container, ask, CardChoice((card,)), 0, [])
        except RequestError:
            too_small.append(card)
            continue
        request = _share_request(grant.core, grant.memory_blocks, ask.count)
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


def _cards_part(ask: ContainerAsk) -> str:
    """The shape's card count, for a share of several cards (``-n2``); one card says nothing,
    so the names of one-card templates are what they always were."""
    return f"-n{ask.count}" if ask.count > 1 else ""


def _share_request(core: int, blocks: int, count: int) -> dict[str, Any]:
    # ``count`` devices of one request are always distinct cards, each charged the capacity:
    # a share of several cards is one request, never one request per card (two requests of
    # one claim may land on the same card).
    return {
        "deviceClassName": dra.DEVICE_CLASS,
        "count": count,
        "capacity": {"requests": {dra.CORES: str(core), dra.MEMORY: dra.memory_quantity(blocks)}},
    }


def _plan(shape: str, request: dict[str, Any], warnings: list[str]) -> ClaimPlan:
    template = {
        "apiVersion": dra.API_VERSION,
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": f"{TEMPLATE_PREFIX}{shape}",
            "labels": dict(TEMPLATE_LABELS),
        },
        "spec": {"spec": {"devices": {"requests": [{"name": REQUEST_NAME, **request}]}}},
    }
    return ClaimPlan(template, tuple(warnings))


def with_policy(plan: ClaimPlan, policy: SharePolicy) -> ClaimPlan:
    """The plan with the share's compute policy in the claim's opaque configuration, where the
    node agent reads it at prepare (core/policy.py); the policy is part of the template's name
    (``-x100`` bursting to a whole card, ``-hi`` high priority), so shares of different
    policies never share a template. A hard cap of low priority is the plan as it was."""
    if policy.default:
        return plan
    template = copy.deepcopy(plan.template)
    suffix = (f"-x{policy.ceiling}" if policy.ceiling else "") + (
        "-hi" if policy.priority is Priority.HIGH else ""
    )
    template["metadata"]["name"] += suffix
    template["spec"]["spec"]["devices"]["config"] = [
        {
            "requests": [REQUEST_NAME],
            "opaque": {"driver": dra.DRIVER, "parameters": policy.to_opaque()},
        }
    ]
    return ClaimPlan(template, plan.warnings)


class TemplateError(RuntimeError):
    """A claim template could not be made sure of; the message says which and why."""


def pod_claim_name(container_kind: str, index: int) -> str:
    """The pod-level claim entry of one GPU container: a DNS label, unique in the pod."""
    prefix = "gpu-init" if container_kind == "initContainers" else "gpu"
    return f"{prefix}-{index}"


class SliceModels:
    """The GPU models the cluster's ResourceSlices publish, for sizing model-dependent shares.

    Each device of the fracgpu driver names its model (``productName``) and its memory capacity;
    a model's memory is the smallest any slice reports for it, so a share sized for the model
    fits every card of it.
    """

    def __init__(self) -> None:
        self._slices: dict[str, dict[str, int]] = {}  # slice name -> product -> MiB
        self._cards: dict[str, tuple[str, int]] = {}  # slice name -> (node, devices)

    def set_slice(self, name: str, slice_spec: Mapping[str, Any]) -> None:
        if slice_spec.get("driver") != dra.DRIVER:
            return
        found: dict[str, int] = {}
        devices = slice_spec.get("devices") or []
        node = slice_spec.get("nodeName") or (slice_spec.get("pool") or {}).get("name") or name
        self._cards[name] = (str(node), len(devices) if isinstance(devices, list) else 0)
        for device in devices:
            attributes = device.get("attributes") or {}
            product = (attributes.get(dra.PRODUCT_ATTRIBUTE) or {}).get("string")
            memory = ((device.get("capacity") or {}).get(dra.MEMORY) or {}).get("value")
            try:
                mib = int(parse_quantity(memory).value) // MIB
            except QuantityError:
                continue
            if isinstance(product, str) and product and mib > 0:
                found[product] = min(mib, found.get(product, mib))
        self._slices[name] = found

    def remove_slice(self, name: str) -> None:
        self._slices.pop(name, None)
        self._cards.pop(name, None)

    def most_cards_on_a_node(self) -> int | None:
        """The most fracgpu cards one node publishes (None: none does), which a claim with
        ``allocationMode: All`` may take at once; quota charges it that many."""
        per_node: dict[str, int] = {}
        for node, count in self._cards.values():
            per_node[node] = per_node.get(node, 0) + count
        return max(per_node.values(), default=None) or None

    def largest_card_mib(self, products: Container[str] | None) -> int | None:
        """Memory of the largest card of these models (None: any), for quota's whole cards."""
        sizes = [
            mib
            for cards in self._slices.values()
            for product, mib in cards.items()
            if products is None or product in products
        ]
        return max(sizes, default=None)

    def models(self) -> dict[str, GpuModel]:
        smallest: dict[str, int] = {}
        for products in self._slices.values():
            for product, mib in products.items():
                smallest[product] = min(mib, smallest.get(product, mib))
        return {product: GpuModel(product, mib) for product, mib in smallest.items()}
