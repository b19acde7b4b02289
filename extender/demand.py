"""What a pod asks of one node's cards: each fracgpu container's share, and the models it chose.

Admission has already rewritten every GPU request into the canonical integers (``fracgpu.io/core``
in hundredths of a card, ``fracgpu.io/memory`` in 256 MiB blocks) and the model choice into
fracgpu's own annotations, so this reads those and nothing of the request language: the
extender must agree with the scheduler's sums and the node's ledger, which count the same
integers.

The model choice is read through ``core.labels`` (the webhook's ``PodModelReader`` is a sibling
component's and sizes requests; the extender only needs the admitted choice), not strictly: an
entry that names no model known now is kept as written, so a pod whose models have no node yet
stays Pending instead of being refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from core.labels import ModelChoiceError, ModelSet, choose_models, model_lists
from core.quantity import quantity_int
from core.units import BLOCK_MIB, CORE, CORE_PER_CARD, MEMORY, cards_phrase


class DemandError(ValueError):
    """A pod the extender cannot place anywhere, whatever the nodes hold; the text says why."""


@dataclass(frozen=True, slots=True)
class ContainerDemand:
    """One container's share: ``core`` hundredths (100·k: k whole cards), ``memory`` blocks."""

    name: str
    core: int
    memory: int

    @property
    def whole(self) -> bool:
        return self.core % CORE_PER_CARD == 0

    def text(self) -> str:
        """The share in the user's units, for messages."""
        if self.whole:
            count = self.core // CORE_PER_CARD
            return f"{count} entirely free card{'s' if count != 1 else ''}"
        return f"{cards_phrase(self.core)} and {self.memory * BLOCK_MIB} MiB"


@dataclass(frozen=True, slots=True)
class PodDemand:
    """Every fracgpu container of a pod, largest first (the order they are placed in)."""

    uid: str
    namespace: str
    name: str
    containers: tuple[ContainerDemand, ...]
    models: ModelSet | None = None

    @property
    def wants_gpu(self) -> bool:
        return bool(self.containers)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def shape(self) -> tuple[object, ...]:
        """What placement depends on (not the pod's identity): a cache key for fit results."""
        return (self.containers, self.models)


def _amount(resources: Mapping[str, Any], key: str) -> int:
    for section in ("limits", "requests"):
        values = resources.get(section)
        if isinstance(values, Mapping) and key in values:
            amount = quantity_int(values[key])
            if amount is None or amount < 0:
                raise DemandError(f"{key} {values[key]!r} is not a whole non-negative number")
            return amount
    return 0


def _containers(items: object) -> Iterable[tuple[str, int, int]]:
    for container in items if isinstance(items, list) else []:
        if not isinstance(container, Mapping):
            continue
        resources = container.get("resources")
        resources = resources if isinstance(resources, Mapping) else {}
        core, memory = _amount(resources, CORE), _amount(resources, MEMORY)
        if core or memory:
            yield str(container.get("name") or ""), core, memory


def pod_demand(pod: Mapping[str, Any], known: Iterable[str] = ()) -> PodDemand:
    """The pod's demand; DemandError when no node could ever host it as written.

    ``known``: the GPU models the cluster's nodes have, to resolve the pod's model choice.
    """
    meta = pod.get("metadata") if isinstance(pod.get("metadata"), Mapping) else {}
    spec = pod.get("spec") if isinstance(pod.get("spec"), Mapping) else {}
    assert isinstance(meta, Mapping) and isinstance(spec, Mapping)
    if any(True for _ in _containers(spec.get("initContainers"))):
        raise DemandError(
            "an init container asks for fracgpu GPU resources, which placement at scheduling "
            "time does not support; give the GPU to an app container"
        )
    containers: list[ContainerDemand] = []
    for name, core, memory in _containers(spec.get("containers")):
        if core <= 0:
            raise DemandError(f"container {name!r} asks for {MEMORY} without {CORE}")
        if core > CORE_PER_CARD and core % CORE_PER_CARD:
            raise DemandError(
                f"container {name!r} asks for {cards_phrase(core)}: more than one card must be "
                "a whole number of cards"
            )
        containers.append(ContainerDemand(name, core, memory))
    containers.sort(key=lambda c: (not c.whole, -c.core, -c.memory, c.name))
    try:
        only, never = model_lists(meta.get("annotations"))
        models = choose_models(only, never, known, strict=False)
    except ModelChoiceError as err:
        raise DemandError(str(err)) from None
    return PodDemand(
        str(meta.get("uid") or ""),
        str(meta.get("namespace") or ""),
        str(meta.get("name") or ""),
        tuple(containers),
        models,
    )
