"""The GPU models a pod chose in its annotations, as admission honours them.

A pod may choose models (``fracgpu.io/gpu-model``, ``-exclude``, and HAMi's annotations when that
dialect is on). Admission checks the choice against the models the cluster knows, denies one
that contradicts the pod's own pin, rewrites HAMi's or substring choices into fracgpu's own
annotations, and in device-plugin mode keeps the pod on those models with node affinity (DRA
mode selects them in the claim instead, ``webhook.claims``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from core.labels import (
    MODEL_ANNOTATION,
    MODEL_EXCLUDE_ANNOTATION,
    PRODUCT_LABEL,
    ModelChoiceError,
    ModelSet,
    choose_models,
    label_value,
    model_key,
    model_lists,
    pinned_products,
)
from core.units import CANONICAL
from webhook.gpumodels import GpuModel
from webhook.podwalk import containers, resource_keys

_CANONICAL = frozenset(CANONICAL)
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"


@dataclass(frozen=True)
class PodModels:
    """The GPU models a pod chose in its annotations, and what admission must say or write.

    ``chosen`` is None when the pod chose nothing. ``write`` holds fracgpu's model annotations
    as they must read when the choice came (also) from HAMi's: quota, ``fracgpu review`` and a
    later admission then read one vocabulary.
    """

    chosen: ModelSet | None = None
    errors: tuple[str, ...] = ()
    write: Mapping[str, str] = field(default_factory=dict)


class PodModelReader:
    """Reads a pod's model choice against ``known``, the models the cluster has: the node
    inventory's in device-plugin mode, those the ResourceSlices publish in DRA mode."""

    def __init__(
        self,
        known: Callable[[], Mapping[str, GpuModel]],
        inputs: frozenset[str],
        *,
        hami: bool,
    ) -> None:
        self.known = known
        self.inputs = inputs
        self.hami = hami

    def read(self, spec: Mapping[str, Any], meta: Mapping[str, Any]) -> PodModels:
        """The pod's model choice, checked against the models the cluster knows.

        Entries are held to the known models only while a request is being sized (first
        admission): the canonical form, and a pod holding claims from our templates, were
        checked when their workload was admitted, and must pass while those models' pools are
        scaled to zero (like the canonical form's memory, see ``webhook.sizing``).
        """
        annotations = meta.get("annotations")
        try:
            only, never = model_lists(annotations, hami=self.hami)
            if not only and not never:
                return PodModels()
            known = self.known()
            chosen = choose_models(only, never, known, strict=self._sizes(spec))
        except ModelChoiceError as exc:
            return PodModels(errors=(str(exc),))
        assert chosen is not None and isinstance(annotations, dict)
        errors: list[str] = []
        pinned = pinned_products(spec)
        if pinned is not None and not any(p in chosen for p in pinned[1]):
            key, products = pinned
            said = " and ".join(lst.annotation for lst in only + never)
            errors.append(
                f"the pod pins {key} to {', '.join(sorted(products))} (nodeSelector or required "
                f"node affinity), which {said} does not allow; choose the model in one place: "
                f"remove the pin, or make the annotation name the pinned model"
            )
        write: dict[str, str] = {}
        if any(lst.substring for lst in only + never) and self._sizes(spec):
            if chosen.only is not None:
                write[MODEL_ANNOTATION] = ",".join(sorted(chosen.only))
            if chosen.excluded:
                write[MODEL_EXCLUDE_ANNOTATION] = ",".join(sorted(chosen.excluded))
        return PodModels(chosen, tuple(errors), write)

    def _sizes(self, spec: Mapping[str, Any]) -> bool:
        """Whether a container asks in a request language rather than the canonical form."""
        for _, _, container in containers(spec):
            resources = container.get("resources")
            for part in ("limits", "requests"):
                section = resources.get(part) if isinstance(resources, dict) else None
                if any(k in self.inputs and k not in _CANONICAL for k in resource_keys(section)):
                    return True
        return False


def model_expressions(chosen: ModelSet) -> list[dict[str, Any]]:
    """The node affinity expressions that keep a pod on the models it chose (device-plugin
    mode): the node label spells a product without spaces, so values are label-safe."""
    exprs: list[dict[str, Any]] = []
    if chosen.only:
        values = sorted({label_value(p) for p in chosen.only})
        exprs.append({"key": PRODUCT_LABEL, "operator": "In", "values": values})
    if chosen.excluded:
        values = sorted({label_value(p) for p in chosen.excluded})
        exprs.append({"key": PRODUCT_LABEL, "operator": "NotIn", "values": values})
    return exprs


def _same_expression(a: Mapping[str, Any], b: object) -> bool:
    if not isinstance(b, dict) or (a["key"], a["operator"]) != (b.get("key"), b.get("operator")):
        return False
    values = b.get("values")
    if not isinstance(values, list):
        return False
    return {model_key(v) for v in a["values"]} == {model_key(str(v)) for v in values}


def affinity_op(
    ops: list[dict[str, Any]], root: str, spec: Mapping[str, Any], exprs: list[dict[str, Any]]
) -> None:
    """AND the expressions with the pod's required node affinity: selector terms are ORed and
    a term's expressions ANDed, so each term gets them (or one term is made). An expression a
    term already has (our earlier output) is not added again."""
    if not exprs:
        return
    affinity = spec.get("affinity")
    new: dict[str, Any] = copy.deepcopy(affinity) if isinstance(affinity, dict) else {}
    node = new.get("nodeAffinity")
    if not isinstance(node, dict):
        node = new["nodeAffinity"] = {}
    required = node.get(REQUIRED)
    if not isinstance(required, dict):
        required = node[REQUIRED] = {}
    terms = required.get("nodeSelectorTerms")
    if not isinstance(terms, list) or not terms:
        required["nodeSelectorTerms"] = [{"matchExpressions": list(exprs)}]
    else:
        for term in terms:
            if not isinstance(term, dict):
                continue  # the API server refuses the pod for it
            have = term.get("matchExpressions")
            if not isinstance(have, list):
                have = term["matchExpressions"] = []
            missing = [e for e in exprs if not any(_same_expression(e, h) for h in have)]
            have.extend(copy.deepcopy(missing))  # each term its own: the patch is JSON
    if new != affinity:
        ops.append({"op": "add", "path": f"{root}/spec/affinity", "value": new})
