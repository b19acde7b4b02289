"""What a pod charges to a GPU quota, computed the way Kubernetes computes pod requests.

Kubernetes (``resourcehelper.PodRequests``, used by the scheduler and ResourceQuota) charges a
pod the larger of (a) its app containers plus its sidecar init containers
(``restartPolicy: Always``), which run together, and (b) each regular init container plus
the sidecars started before it, since init containers run one at a time. Each resource is
combined separately. GPU quota charges the same, so it agrees with what the scheduler and
the device plugin will hold.

A pod holds only the canonical resources here (the validating webhook runs after mutation,
and the controller reads persisted pods), read with :meth:`core.units.Grant.from_resources`.

Whole cards carry no memory in the canonical form (they get all of whichever card they land
on), yet they hold it, and a GPUQuota's ``gpumem`` must count it. They are charged the memory
of the largest card they may land on (the model they are pinned to, else any known model), in
whole 256 MiB blocks as the device plugin advertises a card: never less than they can get.
Where no such card is known (a GPU node pool scaled to zero), ``unsized_cards`` says how many
cards could not be sized, and a quota that limits ``gpumem`` refuses the pod rather than
count it at zero.

A pod chooses its GPU models by a pin (nodeSelector or required node affinity on the product
label) or by its annotations ``fracgpu.io/gpu-model`` and ``fracgpu.io/gpu-model-exclude``
(``core.labels``; the webhook writes HAMi's choice into them): both count alike, against the
per-model limits of the models the pod may land on, and whole cards are charged the largest
card among those models.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from core.labels import ModelChoiceError, ModelSet, model_key, model_lists, pinned_products
from core.units import BLOCK_MIB, Grant, card_blocks
from quota.claims import ClaimSpecs

CardMemory = Callable[[Container[str] | None], int | None]
"""MiB of the largest card among these models (None: any) a pod may land on, if known."""


@dataclass(frozen=True, slots=True)
class Demand:
    """A pod's GPU charge: hundredths of a card, MiB, and the GPU models it may land on.

    ``models`` is None when the pod is not pinned to a GPU model (it may land on any);
    ``excluded`` are models it never lands on (``fracgpu.io/gpu-model-exclude``).
    """

    core: int
    memory_mib: int
    models: frozenset[str] | None = None
    pods: int = 1
    unsized_cards: int = 0  # whole cards whose memory no known card could size
    missing_claims: tuple[str, ...] = ()  # DRA claims the pod names that could not be read
    excluded: frozenset[str] = frozenset()

    def on(self, model: str) -> bool:
        """Whether this demand counts against a per-model limit of ``model`` (either spelling
        of a product, as ``core.labels.model_key`` compares them)."""
        return model in ModelSet(self.models, self.excluded)


def _grant(container: object) -> Grant | None:
    if not isinstance(container, Mapping):
        return None
    resources = container.get("resources")
    if not isinstance(resources, Mapping):
        return None
    # Limits carry the canonical form (requests equal them); fall back to requests in case a
    # client wrote requests only, which the apiserver accepts after defaulting limits.
    for key in ("limits", "requests"):
        section = resources.get(key)
        if isinstance(section, Mapping):
            grant = Grant.from_resources(section)
            if grant is not None:
                return grant
    return None


def _containers(spec: Mapping[str, Any], key: str) -> Iterable[Mapping[str, Any]]:
    items = spec.get(key)
    return [c for c in items if isinstance(c, Mapping)] if isinstance(items, list) else []


def pod_demand(
    pod: Mapping[str, Any],
    card_memory: CardMemory | None = None,
    claims: ClaimSpecs | None = None,
) -> Demand | None:
    """The pod's GPU demand, or None when the pod holds no GPU (quota never affects it).

    ``claims`` (DRA mode): the specs of the claims the pod names, already loaded; what claims
    of the fracgpu class request is added (:mod:`quota.claims`)."""
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        return None
    models, excluded = pod_models(pod)
    restricted = ModelSet(models, excluded) if models is not None or excluded else None
    card_mib = card_memory(restricted) if card_memory is not None else None
    unsized = 0

    def sized(grant: Grant | None) -> Grant:
        nonlocal unsized
        if grant is None:
            return Grant(0, 0)
        if grant.memory_blocks or not grant.whole_cards:
            return grant
        if card_mib is None:
            unsized = max(unsized, grant.whole_cards)
            return grant
        return Grant(grant.core, grant.whole_cards * card_blocks(card_mib))

    core = blocks = 0
    for container in _containers(spec, "containers"):
        grant = sized(_grant(container))
        core += grant.core
        blocks += grant.memory_blocks
    sidecar_core = sidecar_blocks = 0
    init_core = init_blocks = 0
    for container in _containers(spec, "initContainers"):
        grant = sized(_grant(container))
        if container.get("restartPolicy") == "Always":
            core += grant.core
            blocks += grant.memory_blocks
            sidecar_core += grant.core
            sidecar_blocks += grant.memory_blocks
            step_core, step_blocks = sidecar_core, sidecar_blocks
        else:
            step_core = sidecar_core + grant.core
            step_blocks = sidecar_blocks + grant.memory_blocks
        init_core = max(init_core, step_core)
        init_blocks = max(init_blocks, step_blocks)
    core = max(core, init_core)
    blocks = max(blocks, init_blocks)
    missing: tuple[str, ...] = ()
    charge = claims.charge(pod, card_mib) if claims is not None else None
    if charge is not None:
        core, blocks = core + charge.core, blocks + charge.blocks
        unsized, missing = unsized + charge.unsized_cards, charge.missing
    if core == 0 and blocks == 0 and not missing:
        return None
    return Demand(
        core,
        blocks * BLOCK_MIB,
        models,
        unsized_cards=unsized,
        missing_claims=missing,
        excluded=excluded,
    )


def pod_models(pod: Mapping[str, Any]) -> tuple[frozenset[str] | None, frozenset[str]]:
    """The models a pod may land on (None: any) and those it never does, by its pin and its
    model annotations; a pin and an annotation both apply (the webhook denied a pod where
    they contradict). An annotation the webhook would deny counts as absent."""
    spec = pod.get("spec")
    pinned = pinned_products(spec) if isinstance(spec, Mapping) else None
    models = None if pinned is None else pinned[1]
    meta = pod.get("metadata")
    try:
        only, never = model_lists(meta.get("annotations") if isinstance(meta, Mapping) else None)
    except ModelChoiceError:
        return models, frozenset()
    for lst in only:
        chosen = frozenset(lst.entries)
        if models is None:
            models = chosen
        else:
            keys = {model_key(p) for p in chosen}
            models = frozenset(p for p in models if model_key(p) in keys)
    excluded = frozenset(e for lst in never for e in lst.entries)
    return models, excluded


def is_terminal(pod: Mapping[str, Any], at: datetime | None = None) -> bool:
    """Whether the pod no longer holds quota, by the rule of Kubernetes' own pod quota.

    ``QuotaV1Pod`` stops charging pods that Failed or Succeeded, and pods stuck terminating
    past ``deletionTimestamp + deletionGracePeriodSeconds`` (so a dead node cannot keep a
    namespace from scaling up).
    """
    status = pod.get("status")
    phase = status.get("phase") if isinstance(status, Mapping) else None
    if phase in ("Failed", "Succeeded"):
        return True
    meta = pod.get("metadata")
    if not isinstance(meta, Mapping):
        return False
    deleted = meta.get("deletionTimestamp")
    if not isinstance(deleted, str):
        return False
    try:
        since = datetime.fromisoformat(deleted.replace("Z", "+00:00"))
    except ValueError:
        return False
    grace = meta.get("deletionGracePeriodSeconds")
    if not isinstance(grace, int):
        return False
    at = at or datetime.now(UTC)
    return (at - since).total_seconds() > grace
