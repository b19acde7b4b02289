"""The Node labels through which the node agent tells the cluster what cards a node has.

The device plugin *writes* them (``deviceplugin/classic/node.py``); admission and quota *read*
them to size requests and to count a pod against a GPU model. This module is their one definition.

``fracgpu.io/gpu.product``     the card's product name, label-safe (``mixed`` when cards differ)
``fracgpu.io/gpu.memory-mib``  memory of the node's smallest card: the most a container can count on
``fracgpu.io/gpu.count``       number of cards
``fracgpu.io/gpu.inventory``   annotation: versioned JSON with every card

NVIDIA GPU Feature Discovery's ``nvidia.com/gpu.product`` and ``nvidia.com/gpu.memory`` are
read too, so a cluster that already runs it is understood before fracgpu's agent has labelled it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core.units import DOMAIN

PRODUCT_LABEL = f"{DOMAIN}/gpu.product"
MEMORY_LABEL = f"{DOMAIN}/gpu.memory-mib"
COUNT_LABEL = f"{DOMAIN}/gpu.count"
INVENTORY_ANNOTATION = f"{DOMAIN}/gpu.inventory"
INVENTORY_VERSION = 1
# What each card of a node has free, written by the device plugin (device-plugin mode) at most
# once a second as it changes, read by the webhook to tell a waiting pod why, in its units.
FREE_ANNOTATION = f"{DOMAIN}/gpu.free"
FREE_VERSION = 1
GFD_PRODUCT_LABEL = "nvidia.com/gpu.product"
GFD_MEMORY_LABEL = "nvidia.com/gpu.memory"
# (product label, memory label) pairs, most authoritative first.
LABEL_PAIRS = ((PRODUCT_LABEL, MEMORY_LABEL), (GFD_PRODUCT_LABEL, GFD_MEMORY_LABEL))
PRODUCT_LABELS = frozenset(p for p, _ in LABEL_PAIRS)


def pinned_products(pod_spec: Mapping[str, Any]) -> tuple[str, frozenset[str]] | None:
    """The products a pod can only run on, by one product label, or None when unpinned.

    nodeSelector is ANDed with required affinity; affinity terms are ORed, so the terms pin
    only if every term pins.
    """
    selector = pod_spec.get("nodeSelector") or {}
    if isinstance(selector, dict):
        for key in PRODUCT_LABELS:
            value = selector.get(key)
            if isinstance(value, str) and value:
                return key, frozenset({value})
    terms = _dig(
        pod_spec,
        "affinity",
        "nodeAffinity",
        "requiredDuringSchedulingIgnoredDuringExecution",
        "nodeSelectorTerms",
    )
    if not isinstance(terms, list) or not terms:
        return None
    union: set[str] = set()
    label_key = None
    for term in terms:
        term_pin = None
        exprs = _dig(term, "matchExpressions")
        for expr in exprs if isinstance(exprs, list) else []:
            if not isinstance(expr, dict):
                continue
            if expr.get("key") in PRODUCT_LABELS and expr.get("operator") == "In":
                raw = expr.get("values")
                values = [v for v in raw if isinstance(v, str)] if isinstance(raw, list) else []
                if values:
                    term_pin = (expr["key"], values)
                    break
        if term_pin is None:
            return None
        label_key = term_pin[0]
        union.update(term_pin[1])
    assert label_key is not None
    return label_key, frozenset(union)


def _dig(obj: object, *keys: str) -> object:
    """Walk nested maps of an untrusted object; None as soon as a level is missing or odd."""
    for key in keys:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj
