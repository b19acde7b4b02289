"""Where a container's share lies: the placement record and the per-card fit policy.

In extender mode (docs/design/extender-memo.md) the card is chosen at scheduling time. The
scheduler extender writes the choice onto the pod **through the Binding itself** (the API server
merges the Binding's annotations into the pod in the same update that sets ``spec.nodeName``),
and the device plugin reads it back when the container starts. Both sides, and the webhook that
explains a waiting pod, read one annotation, so its key and codec live here, in layer 0.

``fracgpu.io/placement``::

    {"v":1,"node":"gpu-3","containers":{"main":{"cards":["GPU-…"],"core":50,"memoryBlocks":32}}}

Cards are named by **UUID**, never by index: indices change across reboots and card swaps, a
UUID names one card for its life. ``core`` is in hundredths of a card; a whole-card container has
``core`` = 100 per card it holds (its memory is all its own, whatever ``memoryBlocks`` says). Keys
this version does not know are ignored, so a later writer may add fields without a new version;
anything that changes what a known field means takes a new ``v``.

The fit policy (:func:`fit`) is a pure function over plain card states, shared by the extender
(which card a pod is booked on) and, in time, the device plugin (which card a container gets), so
that the two can never disagree on what fits: a share goes to the best-fitting healthy card where
both its core and its memory fit; whole cards go to entirely free cards, on as few NUMA nodes as
possible.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from core.units import CORE_PER_CARD, DOMAIN

PLACEMENT_ANNOTATION = f"{DOMAIN}/placement"
PLACEMENT_VERSION = 1
MAX_RECORD_CHARS = 64 * 1024
"""A record names a few cards per container; anything longer is not one of ours."""


class PlacementError(ValueError):
    """A placement record fracgpu cannot read, phrased with the pod and the value."""


@dataclass(frozen=True, slots=True)
class ContainerPlacement:
    """One container's share: the card(s) it lies on and how much of them it holds."""

    cards: tuple[str, ...]
    core: int
    memory_blocks: int

    @property
    def whole(self) -> bool:
        """Whole cards: the container holds every card it names entirely."""
        return self.core % CORE_PER_CARD == 0

    def problem(self) -> str | None:
        """Why this is no valid share, or None: the rules every reader relies on."""
        if not self.cards:
            return "names no card"
        if any(not isinstance(c, str) or not c for c in self.cards):
            return "has a card that is not a non-empty UUID string"
        if len(set(self.cards)) != len(self.cards):
            return "names a card twice"
        if self.core <= 0:
            return f"has core {self.core}; it must be positive"
        if self.memory_blocks < 0:
            return f"has memoryBlocks {self.memory_blocks}; it must not be negative"
        if self.whole:
            if self.core != CORE_PER_CARD * len(self.cards):
                return (
                    f"holds {self.core // CORE_PER_CARD} whole card(s) but names "
                    f"{len(self.cards)}; whole cards name one card per 100 core"
                )
            return None
        if self.core > CORE_PER_CARD:
            return f"has core {self.core}; a share of a card is 1-99, whole cards are 100 each"
        if len(self.cards) != 1:
            return f"a share of one card names {len(self.cards)} cards"
        return None


@dataclass(frozen=True, slots=True)
class PlacementRecord:
    """Where each of a pod's fracgpu containers lies, on one node."""

    node: str
    containers: Mapping[str, ContainerPlacement] = field(default_factory=dict)

    def __hash__(self) -> int:
        # Mapping fields are not hashable; the rendered form is canonical.
        return hash(render(self))

    def cards(self) -> frozenset[str]:
        """Every card any container of the pod lies on."""
        return frozenset(c for p in self.containers.values() for c in p.cards)


def render(record: PlacementRecord) -> str:
    """The annotation's value: compact, containers sorted by name, so equal records are equal
    strings (the binder compares a pod's record with its booking by value)."""
    document = {
        "v": PLACEMENT_VERSION,
        "node": record.node,
        "containers": containers_json(record.containers),
    }
    return json.dumps(document, separators=(",", ":"))


def containers_json(containers: Mapping[str, ContainerPlacement]) -> dict[str, Any]:
    """Containers as the record (and the ledger's bookings) write them, sorted by name."""
    return {
        name: {"cards": list(p.cards), "core": p.core, "memoryBlocks": p.memory_blocks}
        for name, p in sorted(containers.items())
    }


def parse(raw: object, *, pod: str) -> PlacementRecord:
    """Read a ``fracgpu.io/placement`` value; PlacementError names ``pod``, the value and why."""
    if not isinstance(raw, str):
        raise PlacementError(
            f"pod {pod}: annotation {PLACEMENT_ANNOTATION} must be a JSON string, "
            f"not {type(raw).__name__}"
        )
    shown = raw if len(raw) <= 200 else raw[:200] + "…"

    def fail(why: str) -> PlacementError:
        return PlacementError(f"pod {pod}: annotation {PLACEMENT_ANNOTATION} '{shown}' {why}")

    if len(raw) > MAX_RECORD_CHARS:
        raise fail(f"is longer than {MAX_RECORD_CHARS} characters")
    try:
        document = json.loads(raw)
    except ValueError as err:
        raise fail(f"is not JSON ({err})") from None
    if not isinstance(document, dict):
        raise fail("is not a JSON object")
    version = document.get("v")
    if version != PLACEMENT_VERSION or isinstance(version, bool):
        raise fail(f"has version {version!r}; this fracgpu reads version {PLACEMENT_VERSION}")
    node = document.get("node")
    if not isinstance(node, str) or not node:
        raise fail("names no node")
    try:
        containers = parse_containers(document.get("containers"))
    except PlacementError as err:
        raise fail(str(err)) from None
    return PlacementRecord(node, containers)


def parse_containers(raw: object) -> dict[str, ContainerPlacement]:
    """The ``containers`` object of a record or a booking; PlacementError says what is wrong
    (its caller says where)."""
    if not isinstance(raw, dict) or not raw:
        raise PlacementError("names no container")
    parsed: dict[str, ContainerPlacement] = {}
    for name, body in raw.items():
        placement = _container(body)
        problem = "is not an object with cards, core and memoryBlocks"
        if placement is not None:
            problem = placement.problem() or ""
        if problem:
            raise PlacementError(f"container {name!r} {problem}")
        assert placement is not None
        parsed[str(name)] = placement
    return parsed


def read(annotations: object, *, pod: str) -> PlacementRecord | None:
    """The record in a pod's annotations, or None when it has none (not placed by the
    extender); a record that is there but unreadable raises PlacementError."""
    if not isinstance(annotations, Mapping) or PLACEMENT_ANNOTATION not in annotations:
        return None
    return parse(annotations[PLACEMENT_ANNOTATION], pod=pod)


def _container(body: object) -> ContainerPlacement | None:
    if not isinstance(body, dict):
        return None
    cards, core, blocks = body.get("cards"), body.get("core"), body.get("memoryBlocks", 0)
    if not isinstance(cards, list) or not all(isinstance(c, str) for c in cards):
        return None
    if not _is_int(core) or not _is_int(blocks):
        return None
    return ContainerPlacement(tuple(cards), core, blocks)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


# --- the fit policy ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CardRoom:
    """One card as the fit policy sees it: its size, what is booked on it, whether it works.

    ``index`` orders cards among equals (and NUMA groups); ``uuid`` is what records name.
    """

    index: int
    uuid: str
    blocks: int
    core_used: int = 0
    memory_used: int = 0
    healthy: bool = True
    numa_node: int | None = None

    @property
    def free_core(self) -> int:
        return CORE_PER_CARD - self.core_used

    @property
    def free_memory(self) -> int:
        return self.blocks - self.memory_used

    @property
    def entirely_free(self) -> bool:
        return self.core_used == 0 and self.memory_used == 0

    def holds(self, core: int, memory: int) -> bool:
        """Whether a share of ``core`` and ``memory`` fits this card as it is now."""
        return self.healthy and self.free_core >= core and self.free_memory >= memory


def fit(cards: Sequence[CardRoom], core: int, memory: int) -> list[CardRoom]:
    """The card(s) for a container of ``core`` hundredths and ``memory`` blocks; [] if none.

    ``core`` in hundreds is that many whole cards: entirely free and healthy, on as few NUMA
    nodes as possible (their memory is all theirs, whatever ``memory`` says). A share (1-99)
    goes to the **best fit** among the healthy cards where both amounts fit: partly used cards
    before entirely free ones, then the one left with the least free core, then memory, then
    the lower index. Shares thus pack onto cards in use and whole cards stay whole.
    """
    if core <= 0:
        return []
    by_index = {c.index: c for c in cards}
    if core % CORE_PER_CARD == 0:
        need = core // CORE_PER_CARD
        whole = [c.index for c in cards if c.healthy and c.entirely_free]
        if len(whole) < need:
            return []
        numa = {c.index: c.numa_node for c in cards}
        return [by_index[i] for i in numa_pick(whole, need, numa)]
    if core > CORE_PER_CARD:
        return []
    fitting = [c for c in cards if c.holds(core, memory)]
    if not fitting:
        return []
    best = min(
        fitting,
        key=lambda c: (c.entirely_free, c.free_core - core, c.free_memory - memory, c.index),
    )
    return [best]


def numa_pick(whole: Collection[int], need: int, numa: Mapping[int, int | None]) -> list[int]:
    """``need`` of the ``whole`` cards on as few NUMA nodes as possible, best-fitting node first."""
    groups: dict[int, list[int]] = defaultdict(list)
    for card in sorted(whole):
        node = numa.get(card)
        groups[-1 if node is None else node].append(card)
    fitting = [g for g in groups.values() if len(g) >= need]
    if fitting:
        return min(fitting, key=lambda g: (len(g), g[0]))[:need]
    picked: list[int] = []
    for group in sorted(groups.values(), key=lambda g: (-len(g), g[0])):
        picked += group[: need - len(picked)]
        if len(picked) == need:
            break
    return picked


def booked(cards: Sequence[CardRoom], placements: Collection[ContainerPlacement]) -> list[CardRoom]:
    """``cards`` with ``placements`` added to what is booked on them (whole cards book all).

    Placements naming a card not in ``cards`` are skipped: that card is gone from the node, and
    what it held frees nothing elsewhere.
    """
    core: dict[str, int] = defaultdict(int)
    memory: dict[str, int] = defaultdict(int)
    sizes = {c.uuid: c.blocks for c in cards}
    for p in placements:
        for uuid in p.cards:
            if uuid not in sizes:
                continue
            if p.whole:
                core[uuid] += CORE_PER_CARD
                memory[uuid] += sizes[uuid]
            else:
                core[uuid] += p.core
                memory[uuid] += p.memory_blocks
    return [
        CardRoom(
            c.index,
            c.uuid,
            c.blocks,
            c.core_used + core[c.uuid],
            c.memory_used + memory[c.uuid],
            c.healthy,
            c.numa_node,
        )
        for c in cards
    ]


def overbooked(cards: Sequence[CardRoom]) -> list[CardRoom]:
    """The cards booked beyond their capacity (the ledger invariant I1 says: none)."""
    return [c for c in cards if c.free_core < 0 or c.free_memory < 0]
