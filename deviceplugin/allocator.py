"""What this node holds: cards, their health, and which device IDs are allocated to whom.

One lock guards all of it; the gRPC handlers, the health thread and the reconciler call in from
their own threads. Every change bumps ``version`` and wakes ListAndWatch streams, which then send
the complete list again (kubelet replaces its view with each message).

Honest arithmetic (design §2). kubelet and kube-scheduler count the two resources independently,
so a node whose card 0 has no core left but 40 free memory blocks would advertise 40 blocks that no
container can use. The plugin therefore reports a card's *free* memory IDs Unhealthy while the card
has no free core, and its free core IDs Unhealthy while it has no free memory. Allocated IDs stay
Healthy (their pods keep running). Unhealthy lowers allocatable, so the scheduler sees only capacity
that one card can really host (exact on one-card nodes).

A container's two resources arrive as two Allocate calls, one right after the other, in either order
and never interleaved with another container's. Between them the first half is *pending*: the
counterpart resource on the pending card is not stranded (the container is about to take it), the
preference for the second resource follows the card of the first, and the second Allocate is
checked against the first (core and memory on the same card). A pending half that sees no partner
within ``pair_window_s`` stands alone (a container with one resource only).

Allocations are freed when kubelet's PodResources no longer lists their IDs (``reconcile``):
kubelet never tells a device plugin that a pod ended.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from core.units import BLOCK_MIB, CORE_PER_CARD, card_blocks
from deviceplugin.ids import DeviceId, DeviceIdError, Kind
from deviceplugin.inventory import Card

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


class AllocationError(ValueError):
    """A request that can never work on this node (Allocate fails the pod; it is final)."""


def blocks_per_card(memory_mib: int, block_mib: int) -> int:
    """Memory IDs a card advertises: whole blocks of ``block_mib``."""
    if block_mib == BLOCK_MIB:
        return card_blocks(memory_mib)
    return memory_mib // block_mib


def container_dir_name(core_ids: Iterable[str]) -> str:
    """Name of a container's host directory, derived from its core device IDs.

    Allocate (which sees only the core IDs) and PreStartContainer (which finds them through
    PodResources) compute the same name, and device IDs are exclusive on a node, so two
    containers never share a directory, however alike their requests are.
    """
    digest = hashlib.sha256(",".join(sorted(core_ids)).encode()).hexdigest()
    return f"c-{digest[:32]}"


@dataclass(slots=True)
class Allocation:
    core: tuple[str, ...]
    memory: tuple[str, ...]
    cards: tuple[int, ...]
    created: float  # wall-clock seconds
    key: str = field(default_factory=lambda: uuid.uuid4().hex)
    # PodResources confirmed that one container holds exactly these core and memory IDs
    verified: bool = False

    @property
    def dir_name(self) -> str | None:
        return container_dir_name(self.core) if self.core else None

    def ids(self) -> set[str]:
        return {*self.core, *self.memory}

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "core": list(self.core),
            "memory": list(self.memory),
            "cards": list(self.cards),
            "created": self.created,
            "verified": self.verified,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Allocation:
        return cls(
            core=tuple(str(i) for i in data["core"]),
            memory=tuple(str(i) for i in data["memory"]),
            cards=tuple(int(c) for c in data["cards"]),
            created=float(data["created"]),
            key=str(data["key"]),
            verified=bool(data.get("verified", False)),
        )


@dataclass(frozen=True, slots=True)
class _Half:
    """The first of a container's two Allocate calls, waiting for its partner."""

    kind: Kind
    cards: frozenset[int]
    key: str
    deadline: float  # monotonic


@dataclass(frozen=True, slots=True)
class CardUsage:
    card: Card
    blocks: int
    core_used: int
    memory_used: int
    healthy: bool
    reason: str


@dataclass(frozen=True, slots=True)
class ListedDevice:
    id: str
    healthy: bool
    numa_node: int | None


class Allocator:
    def __init__(
        self,
        cards: Iterable[Card],
        *,
        block_mib: int = BLOCK_MIB,
        pair_window_s: float = 5.0,
        clock: Any = time.monotonic,
        wall: Any = time.time,
    ) -> None:
        self.cards = {c.index: c for c in cards}
        self.block_mib = block_mib
        self.blocks = {i: blocks_per_card(c.memory_mib, block_mib) for i, c in self.cards.items()}
        self.pair_window_s = pair_window_s
        self._clock = clock
        self._wall = wall
        self._health: dict[int, tuple[bool, str]] = {i: (True, "") for i in self.cards}
        self._allocations: dict[str, Allocation] = {}
        self._owner: dict[str, str] = {}  # device ID -> allocation key
        # card -> kind -> allocated numbers, kept in step with _owner (read on every list)
        self._in_use: dict[int, dict[Kind, set[int]]] = {
            i: {Kind.CORE: set(), Kind.MEMORY: set()} for i in self.cards
        }
        # (kind, card) -> (that card's state, its devices as listed): a change to one card
        # rebuilds one card's list, not the node's thousands of entries
        self._lists: dict[tuple[Kind, int], tuple[object, tuple[ListedDevice, ...]]] = {}
        self._half: _Half | None = None
        self._cond = threading.Condition()
        self.version = 0

    # ---- observation -------------------------------------------------------------------

    def wait_for_change(self, seen: int, timeout: float) -> int:
        """Block until ``version`` differs from ``seen`` (or timeout); return the version."""
        deadline = self._clock() + timeout
        with self._cond:
            while True:
                self._expire_half()
                if self.version != seen:
                    return self.version
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return self.version
                if self._half is not None:
                    remaining = min(remaining, max(self._half.deadline - self._clock(), 0.001))
                self._cond.wait(remaining)

    def _changed(self) -> None:
        self.version += 1
        self._cond.notify_all()

    def _expire_half(self) -> None:
        if self._half is not None and self._clock() >= self._half.deadline:
            self._half = None
            self._changed()

    def allocations(self) -> list[Allocation]:
        with self._cond:
            return list(self._allocations.values())

    def usage(self) -> list[CardUsage]:
        with self._cond:
            used = self._used()
            return [
                CardUsage(
                    card=card,
                    blocks=self.blocks[i],
                    core_used=len(used[i][Kind.CORE]),
                    memory_used=len(used[i][Kind.MEMORY]),
                    healthy=self._health[i][0],
                    reason=self._health[i][1],
                )
                for i, card in sorted(self.cards.items())
            ]

    def _used(self) -> dict[int, dict[Kind, set[int]]]:
        return self._in_use

    def _own(self, device: str, key: str) -> None:
        if device not in self._owner:
            parsed = DeviceId.parse(device)
            if parsed.card in self._in_use:
                self._in_use[parsed.card][parsed.kind].add(parsed.number)
        self._owner[device] = key

    def _disown(self, device: str) -> None:
        if self._owner.pop(device, None) is not None:
            parsed = DeviceId.parse(device)
            if parsed.card in self._in_use:
                self._in_use[parsed.card][parsed.kind].discard(parsed.number)

    def _card_states(self, kind: Kind) -> tuple[tuple[bool, frozenset[int] | None], ...]:
        """Per card: (healthy, allocated numbers when the free ones are stranded, else None).

        The device list is a function of this alone, so it is cheap to tell whether a change
        (most allocations) altered anything kubelet sees. Lock held.
        """
        self._expire_half()
        half = self._half
        other = Kind.MEMORY if kind is Kind.CORE else Kind.CORE
        states = []
        for i in sorted(self.cards):
            other_total = self.blocks[i] if kind is Kind.CORE else CORE_PER_CARD
            other_free = other_total - len(self._in_use[i][other])
            partner_pending = half is not None and half.kind is other and i in half.cards
            stranded = not (other_free > 0 or partner_pending)
            states.append(
                (self._health[i][0], frozenset(self._in_use[i][kind]) if stranded else None)
            )
        return tuple(states)

    def devices(self, kind: Kind) -> list[ListedDevice]:
        """The complete ListAndWatch list for one resource, with the honesty rule applied."""
        return [device for card in self.listing(kind)[1] for device in card]

    def listing(self, kind: Kind) -> tuple[object, list[tuple[ListedDevice, ...]]]:
        """A signature of the device list and the list itself per card, from one snapshot.

        Equal signatures mean equal lists (ListAndWatch skips identical resends). A card's
        tuple is the same object for as long as that card's state holds, so callers may cache
        what they derive from it by identity; a change to one card rebuilds that card only.
        """
        with self._cond:
            states = self._card_states(kind)
            lists = []
            for (i, card), state in zip(sorted(self.cards.items()), states, strict=True):
                cached = self._lists.get((kind, i))
                if cached is None or cached[0] != state:
                    healthy, stranded = state
                    total = CORE_PER_CARD if kind is Kind.CORE else self.blocks[i]
                    listed = tuple(
                        ListedDevice(
                            str(DeviceId(i, kind, n)),
                            healthy and (stranded is None or n in stranded),
                            card.numa_node,
                        )
                        for n in range(total)
                    )
                    cached = self._lists[(kind, i)] = (state, listed)
                lists.append(cached[1])
            return states, lists

    # ---- health ------------------------------------------------------------------------

    def set_health(self, card: int, healthy: bool, reason: str = "") -> bool:
        """Record a card's health; True when it changed (ListAndWatch streams then resend)."""
        with self._cond:
            if card not in self._health or self._health[card][0] == healthy:
                return False
            self._health[card] = (healthy, reason)
            log.warning(
                "card health changed",
                extra={"card": card, "healthy": healthy, "reason": reason},
            )
            self._changed()
            return True

    def is_healthy(self, card: int) -> bool:
        with self._cond:
            return self._health.get(card, (False, ""))[0]

    # ---- Allocate ----------------------------------------------------------------------

    def _parse(self, kind: Kind, ids: Iterable[str], resource: str) -> dict[int, list[int]]:
        by_card: dict[int, list[int]] = defaultdict(list)
        seen: set[str] = set()
        for text in ids:
            try:
                parsed = DeviceId.parse(text)
            except DeviceIdError as exc:
                raise AllocationError(f"{resource}: {exc}") from None
            if text in seen:
                raise AllocationError(f"{resource}: device ID {text!r} appears twice")
            seen.add(text)
            if parsed.kind is not kind:
                raise AllocationError(
                    f"{resource}: device ID {text!r} belongs to the other fracgpu resource"
                )
            total = CORE_PER_CARD if kind is Kind.CORE else self.blocks.get(parsed.card, 0)
            if parsed.card not in self.cards or parsed.number >= total:
                raise AllocationError(
                    f"{resource}: device ID {text!r} is unknown on this node "
                    f"(cards: {sorted(self.cards)})"
                )
            by_card[parsed.card].append(parsed.number)
        if not by_card:
            raise AllocationError(f"{resource}: the request holds no device IDs")
        return by_card

    def _check_shape(self, kind: Kind, by_card: Mapping[int, list[int]], resource: str) -> None:
        if len(by_card) == 1:
            return
        counts = ", ".join(f"card {c}: {len(n)}" for c, n in sorted(by_card.items()))
        if kind is Kind.CORE:
            if all(len(n) == CORE_PER_CARD for n in by_card.values()):
                return
            raise AllocationError(
                f"{resource}: {sum(len(n) for n in by_card.values())} IDs span cards ({counts}); "
                f"a share of a card must lie on one card and whole cards take all "
                f"{CORE_PER_CARD} IDs of each. Request 1–100 (one card) or a multiple of 100."
            )
        if all(len(n) == self.blocks[c] for c, n in by_card.items()):
            return
        raise AllocationError(
            f"{resource}: memory IDs span cards ({counts}); a container's memory must lie on the "
            f"card of its core share, or be the whole memory of each of its whole cards"
        )

    def allocate(self, kind: Kind, ids: list[str], resource: str) -> Allocation:
        """Record one Allocate container request; raise AllocationError if it can never work."""
        try:
            by_card = self._parse(kind, ids, resource)
            self._check_shape(kind, by_card, resource)
        except AllocationError:
            self._abandon_half(kind)
            raise
        cards = frozenset(by_card)
        with self._cond:
            self._expire_half()
            for device in ids:
                stale = self._owner.get(device)
                if stale is not None:
                    # kubelet is the authority on what is free: it reused IDs of a container
                    # that ended before the reconciler noticed.
                    self._drop(stale, why="kubelet reassigned its devices")
            half = self._half
            if half is not None and half.kind is not kind and half.key in self._allocations:
                self._half = None
                partner = self._allocations[half.key]
                if half.cards != cards:
                    self._drop(half.key, why="partner allocation failed")
                    self._changed()
                    here = ",".join(str(c) for c in sorted(cards))
                    there = ",".join(str(c) for c in sorted(half.cards))
                    raise AllocationError(
                        f"{resource}: kubelet assigned this container's {kind.name.lower()} on "
                        f"card {here} but its {half.kind.name.lower()} on card {there}; both "
                        f"must be on the same card. This happens when no single card had both "
                        f"free; delete the pod so that it is scheduled again."
                    )
                if kind is Kind.CORE:
                    partner.core = tuple(ids)
                else:
                    partner.memory = tuple(ids)
                for device in ids:
                    self._own(device, partner.key)
                self._changed()
                return partner
            allocation = Allocation(
                core=tuple(ids) if kind is Kind.CORE else (),
                memory=tuple(ids) if kind is Kind.MEMORY else (),
                cards=tuple(sorted(cards)),
                created=self._wall(),
            )
            self._add(allocation)
            self._half = _Half(kind, cards, allocation.key, self._clock() + self.pair_window_s)
            self._changed()
            return allocation

    def _abandon_half(self, kind: Kind) -> None:
        """The container's second Allocate failed: kubelet rejects the pod and frees its first."""
        with self._cond:
            self._expire_half()
            half = self._half
            if half is not None and half.kind is not kind:
                self._half = None
                self._drop(half.key, why="partner allocation failed")
                self._changed()

    def _add(self, allocation: Allocation) -> None:
        self._allocations[allocation.key] = allocation
        for device in allocation.ids():
            self._own(device, allocation.key)

    def _drop(self, key: str, *, why: str) -> None:
        allocation = self._allocations.pop(key, None)
        if allocation is None:
            return
        for device in allocation.ids():
            if self._owner.get(device) == key:
                self._disown(device)
        log.info(
            "allocation freed",
            extra={"cards": list(allocation.cards), "dir": allocation.dir_name, "why": why},
        )

    # ---- GetPreferredAllocation --------------------------------------------------------

    def preferred(
        self, kind: Kind, available: Iterable[str], must_include: Iterable[str], size: int
    ) -> list[str]:
        """The IDs this container should get, or [] to leave the choice to kubelet."""
        free: dict[int, list[int]] = defaultdict(list)
        for text in available:
            try:
                parsed = DeviceId.parse(text)
            except DeviceIdError:
                continue
            if parsed.kind is kind and parsed.card in self.cards:
                free[parsed.card].append(parsed.number)
        must: dict[int, list[int]] = defaultdict(list)
        for text in must_include:
            try:
                parsed = DeviceId.parse(text)
            except DeviceIdError:
                return []
            must[parsed.card].append(parsed.number)
        with self._cond:
            self._expire_half()
            half = self._half
        hint = half.cards if half is not None and half.kind is not kind else None
        cards = self._choose_cards(kind, free, set(must), size, hint)
        if not cards:
            return []
        chosen: list[str] = []
        remaining = size
        for card in cards:
            take = self._per_card_amount(kind, card, size, len(cards))
            numbers = sorted(set(must.get(card, [])))
            rest = sorted(set(free[card]) - set(numbers))
            numbers += rest[: max(take - len(numbers), 0)]
            chosen += [str(DeviceId(card, kind, n)) for n in numbers]
            remaining -= len(numbers)
        return chosen if remaining == 0 else []

    def _per_card_amount(self, kind: Kind, card: int, size: int, cards: int) -> int:
        if cards == 1:
            return size
        return CORE_PER_CARD if kind is Kind.CORE else self.blocks[card]

    def _choose_cards(
        self,
        kind: Kind,
        free: Mapping[int, list[int]],
        must: set[int],
        size: int,
        hint: frozenset[int] | None,
    ) -> list[int]:
        def full(card: int) -> bool:
            total = CORE_PER_CARD if kind is Kind.CORE else self.blocks[card]
            return len(free.get(card, ())) == total

        if hint is not None:
            if len(hint) == 1:
                (card,) = hint
                if len(free.get(card, ())) >= size:
                    return [card]
            elif size == sum(self._per_card_amount(kind, c, size, len(hint)) for c in hint) and all(
                full(c) for c in hint
            ):
                return sorted(hint)
        candidates = [c for c in free if not must or c in must]
        largest = max((len(free[c]) for c in candidates), default=0)
        single_limit = CORE_PER_CARD if kind is Kind.CORE else largest
        if size <= single_limit:
            fitting = [c for c in candidates if len(free[c]) >= size]
            if not fitting:
                return []
            # The other resource comes next and must fit on the same card, but its size is not
            # known yet. Requests are close to proportional (the webhook's defaults make them
            # so), so prefer cards whose other resource has at least the same share free.
            share = size / (CORE_PER_CARD if kind is Kind.CORE else max(self.blocks.values()))
            balanced = [c for c in fitting if self._other_free_share(kind, c) >= share]
            # Best fit: the card left with the least free after this container, so fractions
            # pack onto partly used cards and whole cards stay whole.
            return [min(balanced or fitting, key=lambda c: (len(free[c]) - size, c))]
        whole = [c for c in candidates if full(c)]
        if kind is Kind.CORE:
            if size % CORE_PER_CARD:
                return []
            need = size // CORE_PER_CARD
        else:
            per = {self.blocks[c] for c in whole}
            if len(per) != 1 or size % next(iter(per)):
                return []
            need = size // next(iter(per))
        if len(whole) < need:
            return []
        return self._numa_pick(whole, need)

    def _other_free_share(self, kind: Kind, card: int) -> float:
        other = Kind.MEMORY if kind is Kind.CORE else Kind.CORE
        total = self.blocks[card] if other is Kind.MEMORY else CORE_PER_CARD
        with self._cond:
            used = len(self._in_use[card][other])
        return (total - used) / total if total else 0.0

    def _numa_pick(self, whole: list[int], need: int) -> list[int]:
        """Whole cards, as few NUMA nodes as possible: best-fitting node first."""
        groups: dict[int, list[int]] = defaultdict(list)
        for card in sorted(whole):
            node = self.cards[card].numa_node
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

    # ---- PodResources reconciliation and the checkpoint --------------------------------

    def find(self, kind: Kind, ids: Iterable[str]) -> Allocation | None:
        with self._cond:
            keys = {self._owner.get(i) for i in ids}
            if len(keys) != 1 or None in keys:
                return None
            return self._allocations[next(iter(keys))]  # type: ignore[index]

    def verify(self, core: Iterable[str], memory: Iterable[str]) -> Allocation:
        """Record that PodResources lists one container holding exactly these IDs."""
        core, memory = sorted(core), sorted(memory)
        known = self.find(Kind.CORE, core)
        with self._cond:
            if (
                known is not None
                and known.key in self._allocations
                and sorted(known.core) == core
                and sorted(known.memory) == memory
            ):
                known.verified = True
                return known
        adopted = self.adopt(core, memory)
        adopted.verified = True
        return adopted

    def adopt(self, core: list[str], memory: list[str]) -> Allocation:
        """Record a container learnt from PodResources (PreStartContainer, restart recovery)."""
        cards = {DeviceId.parse(i).card for i in [*core, *memory]}
        with self._cond:
            for device in [*core, *memory]:
                stale = self._owner.get(device)
                if stale is not None:
                    self._drop(stale, why="superseded by PodResources")
            allocation = Allocation(tuple(core), tuple(memory), tuple(sorted(cards)), self._wall())
            self._add(allocation)
            self._changed()
            return allocation

    def reconcile(
        self,
        listed: Iterable[tuple[Collection[str], Collection[str]]],
        listed_at: float,
        grace_s: float,
    ) -> list[Allocation]:
        """Align with PodResources ``List`` (core IDs, memory IDs per container).

        Frees allocations none of whose IDs are listed (unless younger than ``grace_s`` at the
        time of the listing: an Allocate can race the List) and adopts listed containers that
        are unknown. Returns the freed allocations.

        It runs every pass over a full node (thousands of IDs) while RPCs wait for the
        interpreter lock, so the common case, a container listed exactly as recorded, is
        settled with set operations that run per ID in C, not in Python bytecode.
        """
        containers = [(frozenset(c), frozenset(m)) for c, m in listed if c or m]
        listed_ids: set[str] = set()
        for core, memory in containers:
            listed_ids |= core
            listed_ids |= memory
        freed = []
        adopted = 0
        with self._cond:
            for key, allocation in list(self._allocations.items()):
                if not listed_ids.isdisjoint(allocation.core) or not listed_ids.isdisjoint(
                    allocation.memory
                ):
                    continue
                if allocation.created > listed_at - grace_s:
                    continue
                freed.append(allocation)
                self._drop(key, why="no longer listed by kubelet")
            owner = self._owner
            for core, memory in containers:
                holder = owner.get(next(iter(core or memory)))
                record = self._allocations.get(holder) if holder is not None else None
                if (
                    record is not None
                    and core == frozenset(record.core)
                    and memory == frozenset(record.memory)
                    and set(map(owner.get, chain(core, memory))) == {holder}
                ):
                    continue
                # Unknown, or held differently than recorded (kubelet reassigned IDs while
                # this plugin was not looking): kubelet's listing wins.
                for stale in {owner[i] for i in (*core, *memory) if i in owner}:
                    self._drop(stale, why="superseded by PodResources")
                cards = {DeviceId.parse(i).card for i in (*core, *memory)}
                listed_as = (tuple(sorted(core)), tuple(sorted(memory)))
                self._add(Allocation(*listed_as, tuple(sorted(cards)), 0.0))
                adopted += 1
            if freed or adopted:  # a quiet pass wakes no ListAndWatch stream
                self._changed()
        return freed

    def restore(self, allocations: Iterable[Allocation]) -> None:
        with self._cond:
            for allocation in allocations:
                if all(DeviceId.parse(i).card in self.cards for i in allocation.ids()):
                    self._add(allocation)
            self._changed()
