"""The Node labels through which the node agent tells the cluster what cards a node has.

The device plugin *writes* them (``deviceplugin/classic/node.py``); admission and quota *read*
them to size requests and to count a pod against a GPU model. This module is their one definition.

``fracgpu.io/gpu.product``     the card's product name, label-safe (``mixed`` when cards differ)
``fracgpu.io/gpu.memory-mib``  memory of the node's smallest card: the most a container can count on
``fracgpu.io/gpu.count``       number of cards
``fracgpu.io/gpu.inventory``   annotation: versioned JSON with every card

A pod may also choose its GPU model in its own annotations instead of pinning a label (issue
#28): ``fracgpu.io/gpu-model`` (only these models) and ``fracgpu.io/gpu-model-exclude`` (never
these), and, with the HAMi dialect, HAMi's ``nvidia.com/use-gputype`` and
``nvidia.com/nouse-gputype``. This module parses and matches them, so that admission (which
honours the choice) and quota (which counts the pod against the chosen models) agree.

NVIDIA GPU Feature Discovery's ``nvidia.com/gpu.product`` and ``nvidia.com/gpu.memory`` are
read too, so a cluster that already runs it is understood before fracgpu's agent has labelled it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
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

# A pod's choice of GPU model, in its own annotations (all of its GPU containers).
MODEL_ANNOTATION = f"{DOMAIN}/gpu-model"
MODEL_EXCLUDE_ANNOTATION = f"{DOMAIN}/gpu-model-exclude"
# HAMi's, read only when the HAMi dialect is on: entries are parts of the card's name.
HAMI_MODEL_ANNOTATION = "nvidia.com/use-gputype"
HAMI_EXCLUDE_ANNOTATION = "nvidia.com/nouse-gputype"
MAX_MODEL_ENTRIES = 32
MAX_MODEL_CHARS = 128
"""Bounds on a model list: a pod names a handful of models, and the list becomes CEL in a claim
template, whose expression the API server limits to 10 KiB."""
EXACT_RULE = (
    "entries are GPU product names as the node label fracgpu.io/gpu.product or the "
    "ResourceSlice's productName spells them, compared without regard to case"
)
SUBSTRING_RULE = "entries are parts of a GPU product name, compared without regard to case"


def label_value(product: str) -> str:
    """A product name as the node label spells it (≤ 63 chars of [A-Za-z0-9._-], alphanumeric
    at both ends): what node affinity must compare, since a label value cannot hold a space."""
    value = re.sub(r"[^A-Za-z0-9._-]+", "-", product.strip())[:63]
    value = re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)
    return value or "unknown"


def model_key(product: str) -> str:
    """What two spellings of one model share: the node label's spelling, without case. The same
    card is ``NVIDIA A100-SXM4-40GB`` in a ResourceSlice and ``NVIDIA-A100-SXM4-40GB`` on its
    node, and a user may write either."""
    return label_value(product).casefold()


class ModelChoiceError(ValueError):
    """A model annotation fracgpu cannot honour, phrased for the person who wrote it."""


@dataclass(frozen=True, slots=True)
class ModelList:
    """One model annotation as written: its name, its value, its entries and how they match."""

    annotation: str
    value: str
    entries: tuple[str, ...]
    substring: bool = False

    @property
    def rule(self) -> str:
        return SUBSTRING_RULE if self.substring else EXACT_RULE

    def matches(self, entry: str, product: str) -> bool:
        if self.substring:
            return entry.casefold() in product.casefold()
        return model_key(entry) == model_key(product)


def parse_model_list(annotation: str, raw: object, *, substring: bool = False) -> ModelList:
    """Parse a comma-separated model list; ModelChoiceError names what is wrong and the fix."""
    fix = f"write {annotation} as product names separated by single commas"
    if not isinstance(raw, str):
        raise ModelChoiceError(f"annotation {annotation} must be a string; {fix}")
    entries = [e.strip() for e in raw.split(",")]
    shown = _show(raw)
    if not raw.strip():
        raise ModelChoiceError(f"annotation {annotation} is empty; {fix}, or remove the annotation")
    if any(not e for e in entries):
        raise ModelChoiceError(f"annotation {annotation} {shown} has an empty entry; {fix}")
    if len(entries) > MAX_MODEL_ENTRIES:
        raise ModelChoiceError(
            f"annotation {annotation} names {len(entries)} models, more than "
            f"{MAX_MODEL_ENTRIES}; name fewer"
        )
    long = [e for e in entries if len(e) > MAX_MODEL_CHARS]
    if long:
        raise ModelChoiceError(
            f"annotation {annotation} has an entry of {len(long[0])} characters; a GPU product "
            f"name has at most {MAX_MODEL_CHARS}; {fix}"
        )
    seen: set[str] = set()
    for entry in entries:
        key = entry.casefold()
        if key in seen:
            raise ModelChoiceError(
                f"annotation {annotation} {shown} names {_show(entry)} twice; name each model once"
            )
        seen.add(key)
    return ModelList(annotation, raw, tuple(entries), substring)


def model_lists(
    annotations: object, *, hami: bool = False
) -> tuple[tuple[ModelList, ...], tuple[ModelList, ...]]:
    """The pod's model lists, (only these, never these); HAMi's are read when ``hami`` is set."""
    if not isinstance(annotations, Mapping):
        return (), ()
    names = [(MODEL_ANNOTATION, False, True), (MODEL_EXCLUDE_ANNOTATION, False, False)]
    if hami:
        names += [(HAMI_MODEL_ANNOTATION, True, True), (HAMI_EXCLUDE_ANNOTATION, True, False)]
    only: list[ModelList] = []
    never: list[ModelList] = []
    for name, substring, allow in names:
        if name in annotations:
            parsed = parse_model_list(name, annotations[name], substring=substring)
            (only if allow else never).append(parsed)
    return tuple(only), tuple(never)


@dataclass(frozen=True, slots=True)
class ModelSet:
    """The GPU models a pod may get: those in ``only`` (None: any) and none in ``excluded``.

    Names are the cluster's spellings where a known model matched, else as written. Membership
    (``product in models``) compares by :func:`model_key`, so either spelling of a model is in.
    """

    only: frozenset[str] | None = None
    excluded: frozenset[str] = frozenset()

    def __contains__(self, product: object) -> bool:
        if not isinstance(product, str):
            return False
        key = model_key(product)
        if self.only is not None and key not in {model_key(p) for p in self.only}:
            return False
        return key not in {model_key(p) for p in self.excluded}

    def among(self, known: Iterable[str]) -> list[str]:
        """The known models this set allows, sorted."""
        return sorted(p for p in set(known) if p in self)


def choose_models(
    only: Iterable[ModelList],
    never: Iterable[ModelList],
    known: Iterable[str],
    *,
    strict: bool,
) -> ModelSet | None:
    """The models a pod's lists allow among the ``known`` ones (None: the pod chose nothing).

    ``strict`` (a request being sized at its first admission): an entry that matches no known
    model, and a choice that leaves no known model, are refused. Otherwise (our own earlier
    output, or no model known at all, e.g. a pool scaled to zero) an exact entry that matches
    nothing is kept as written and a part of a name (HAMi's) is dropped, so a Deployment's
    pods are still created while the models it chose have no node; HAMi's lists are then read
    only where fracgpu's, which admission wrote from them, are absent.
    """
    only, never = tuple(only), tuple(never)
    if not only and not never:
        return None
    if not strict and any(not lst.substring for lst in only + never):
        # Admitted already: fracgpu's annotations hold HAMi's choice as it was resolved then,
        # which parts of names, matched against the models known now, may no longer agree with.
        only = tuple(lst for lst in only if not lst.substring)
        never = tuple(lst for lst in never if not lst.substring)
    models = sorted(set(known))
    allowed: frozenset[str] | None = None
    for lst in only:
        names = _resolve(lst, models, strict=strict)
        if not names and lst.substring:
            continue  # parts of names that match nothing now: the pod was admitted already
        allowed = names if allowed is None else _intersect(allowed, names)
    excluded: set[str] = set()
    for lst in never:
        excluded.update(_resolve(lst, models, strict=strict))
    if allowed is not None:
        # One list is simpler to read back (and to write as node affinity) than two.
        allowed = frozenset(p for p in allowed if p in ModelSet(excluded=frozenset(excluded)))
        excluded = set()
    chosen = ModelSet(allowed, frozenset(excluded))
    said = " and ".join(f"{lst.annotation} {_show(lst.value)}" for lst in only + never)
    if strict and models and not chosen.among(models):
        raise ModelChoiceError(
            f"{said}: no GPU model of this cluster is left (known: {', '.join(models)}); "
            f"allow at least one of them, or exclude fewer"
        )
    if strict and allowed is not None and not allowed:
        raise ModelChoiceError(
            f"{said}: every model chosen is also excluded; remove it from one of them"
        )
    return chosen


def _resolve(lst: ModelList, known: list[str], *, strict: bool) -> frozenset[str]:
    names: set[str] = set()
    for entry in lst.entries:
        found = [p for p in known if lst.matches(entry, p)]
        if found:
            names.update(found)
        elif strict and known:
            raise ModelChoiceError(
                f"{lst.annotation} {_show(entry)} matches no GPU model in this cluster "
                f"({lst.rule}); known: {', '.join(known)}; write one of them, comma-separated"
            )
        elif strict and lst.substring:
            raise ModelChoiceError(
                f"{lst.annotation} {_show(entry)} cannot be matched: no GPU model is known to "
                f"fracgpu yet, and a part of a name is matched against known models; write the "
                f"exact product name in {MODEL_ANNOTATION} instead"
            )
        elif not lst.substring:
            names.add(entry)
    return frozenset(names)


def _intersect(a: frozenset[str], b: frozenset[str]) -> frozenset[str]:
    keys = {model_key(p) for p in b}
    return frozenset(p for p in a if model_key(p) in keys)


def _show(text: str) -> str:
    return "'" + (text if len(text) <= 80 else text[:80] + "…") + "'"


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
