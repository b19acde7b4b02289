"""Each node's cards as the extender sees them, and where a pod would lie on them.

The cards come from the Node: the device plugin publishes every card (index, UUID, product,
memory, NUMA node, health) in the ``fracgpu.io/gpu.inventory`` annotation (``core.labels``).
What is taken comes from the node's ``GPUNodeLedger`` bookings, never from pods: a booking is
written before the pod's Binding, so the ledger is never behind the pods it placed.

A pod is placed greedily, whole-card containers first, then shares largest first, each by the
shared fit policy (``core.placement.fit``) over the cards left by those before it. Greedy is
conservative: it may refuse a pod an exhaustive search would place, never the reverse, and the
binder places with the same function, so what filter passed the binder places alike (unless
the ledger changed in between, which the binder then reports).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from core.labels import INVENTORY_ANNOTATION, INVENTORY_VERSION
from core.placement import CardRoom, ContainerPlacement, booked, fit
from core.units import BLOCK_MIB, CORE_PER_CARD, card_blocks
from extender.demand import ContainerDemand, PodDemand
from extender.ledger import Ledger

NO_INVENTORY = (
    "no GPU inventory published on the node yet (fracgpu's device plugin writes "
    f"{INVENTORY_ANNOTATION} when it starts)"
)


@dataclass(frozen=True, slots=True)
class NodeCards:
    """A node's cards as its device plugin published them; ``products`` by UUID."""

    node: str
    cards: tuple[CardRoom, ...]
    products: Mapping[str, str] = field(default_factory=dict)

    def __hash__(self) -> int:
        return hash((self.node, self.cards))

    def allowed(self, demand: PodDemand) -> tuple[CardRoom, ...]:
        """The cards of the models the pod may get."""
        if demand.models is None:
            return self.cards
        return tuple(c for c in self.cards if self.products.get(c.uuid, "") in demand.models)


def node_cards(node: Mapping[str, Any]) -> NodeCards | None:
    """The cards the Node's inventory annotation lists; None when it has none readable."""
    meta = node.get("metadata") if isinstance(node.get("metadata"), Mapping) else {}
    assert isinstance(meta, Mapping)
    annotations = meta.get("annotations") if isinstance(meta.get("annotations"), Mapping) else {}
    assert isinstance(annotations, Mapping)
    raw = annotations.get(INVENTORY_ANNOTATION)
    try:
        document = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        return None
    if not isinstance(document, dict) or document.get("version") != INVENTORY_VERSION:
        return None
    entries = document.get("cards")
    if not isinstance(entries, list):
        return None
    cards: list[CardRoom] = []
    products: dict[str, str] = {}
    for entry in entries:
        card = _card(entry)
        if card is None:
            continue
        cards.append(card)
        products[card.uuid] = str(entry.get("product") or "")
    cards.sort(key=lambda c: c.index)
    return NodeCards(str(meta.get("name") or ""), tuple(cards), products)


def _card(entry: object) -> CardRoom | None:
    """One inventory entry; None for an entry without a usable UUID, index or memory (a card
    the extender cannot name in a record, it does not offer)."""
    if not isinstance(entry, dict):
        return None
    uuid, index, memory = entry.get("uuid"), entry.get("index"), entry.get("memoryMiB")
    numa = entry.get("numaNode")
    if not isinstance(uuid, str) or not uuid:
        return None
    if not isinstance(index, int) or not isinstance(memory, int) or memory < BLOCK_MIB:
        return None
    return CardRoom(
        index,
        uuid,
        card_blocks(memory),
        healthy=entry.get("healthy") is True,
        numa_node=numa if isinstance(numa, int) and not isinstance(numa, bool) else None,
    )


@dataclass(frozen=True, slots=True)
class Placed:
    """Where a pod would lie (``containers``), or which container found no room (``failed``)."""

    containers: Mapping[str, ContainerPlacement] | None
    failed: ContainerDemand | None = None
    after: tuple[CardRoom, ...] = ()


def place_pod(cards: Sequence[CardRoom], demand: PodDemand) -> Placed:
    """Place every container of ``demand`` on ``cards`` (already narrowed to allowed models),
    largest first, each on what the ones before it left."""
    current = list(cards)
    placed: dict[str, ContainerPlacement] = {}
    for container in demand.containers:
        chosen = fit(current, container.core, container.memory)
        if not chosen:
            return Placed(None, container, tuple(current))
        placement = ContainerPlacement(
            tuple(c.uuid for c in chosen), container.core, container.memory
        )
        placed[container.name] = placement
        current = booked(current, [placement])
    return Placed(placed, None, tuple(current))


@dataclass(frozen=True, slots=True)
class Verdict:
    """One node for one pod: where it would lie, or why not and whether it ever could."""

    placed: Placed
    reason: str = ""
    unresolvable: bool = False

    @property
    def fits(self) -> bool:
        return self.placed.containers is not None


def judge(cards: NodeCards | None, ledger: Ledger | None, demand: PodDemand) -> Verdict:
    """Whether ``demand`` fits the node now, with the pod's own booking left out (a retried
    pod may reuse it); unresolvable when it would not fit even an empty node."""
    if cards is None:
        return Verdict(Placed(None), NO_INVENTORY, unresolvable=True)
    allowed = cards.allowed(demand)
    if not allowed:
        return Verdict(Placed(None), "no card of the GPU models the pod chose", unresolvable=True)
    empty = place_pod([c for c in allowed if c.healthy], demand)
    if empty.failed is not None:
        return Verdict(empty, _never(empty.failed), unresolvable=True)
    taken = ledger.placements(exclude=demand.uid) if ledger is not None else []
    now = place_pod(booked(allowed, taken), demand)
    if now.failed is not None:
        return Verdict(now, _not_now(now.failed))
    return Verdict(now)


def _never(container: ContainerDemand) -> str:
    if container.whole:
        count = container.core // CORE_PER_CARD
        return f"fewer than {count} healthy card{_s(count)} of the models the pod may use"
    return f"no healthy card of the models the pod may use can hold {container.text()}"


def _not_now(container: ContainerDemand) -> str:
    if container.whole:
        count = container.core // CORE_PER_CARD
        return f"fewer than {count} card{_s(count)} entirely free"
    return f"no single card has {container.text()} free"


def _s(count: int) -> str:
    return "" if count == 1 else "s"
