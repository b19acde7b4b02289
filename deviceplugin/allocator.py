"""What this node holds: cards, their health, and which device IDs are allocated to whom.

One lock guards all of it; the gRPC handlers, the health thread and the reconciler call in from
their own threads. Every change bumps ``version`` and wakes ListAndWatch streams, which then send
the complete list again (kubelet replaces its view with each message).

The allocator owns ID ownership, card health and reconciliation with kubelet's PodResources. It
delegates the rest to units that hold no lock of their own: which free IDs are advertised and
which card a container should get (``placement``, pure functions over a snapshot taken here), the
pairing of a container's two Allocate calls (``pairing``) and the per-card ListAndWatch lists
(``listing``).

Allocations are freed when kubelet's PodResources no longer lists their IDs (``reconcile``):
kubelet never tells a device plugin that a pod ended. A listing that misses an allocation is
only believed when a second listing, at least ``confirm_s`` later, misses it too: a kubelet that
has just restarted can answer with an empty or partial list while its containers still run.
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

from core.units import CORE_PER_CARD, card_blocks
from deviceplugin import placement
from deviceplugin.ids import DeviceId, DeviceIdError, Kind
from deviceplugin.inventory import Card
from deviceplugin.listing import CardListState, ListedDevice, ListingCache
from deviceplugin.pairing import Clock, Half, Pairing

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


class AllocationError(ValueError):
    """A request that can never work on this node (Allocate fails the pod; it is final)."""


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
    created: float  # wall-clock seconds; ADOPTED for a container learnt from a listing
    key: str = field(default_factory=lambda: uuid.uuid4().hex)
    # PodResources confirmed that one container holds exactly these core and memory IDs
    verified: bool = False

    @property
    def dir_name(self) -> str | None:
        return container_dir_name(self.core) if self.core else None

    def ids(self) -> set[str]:
        return {*self.core, *self.memory}

    @property
    def whole_cards_only(self) -> bool:
        """Whole cards admitted without memory: all core IDs of each card, no memory IDs."""
        return (
            bool(self.core)
            and not self.memory
            and len(self.core) == CORE_PER_CARD * len(self.cards)
        )

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
        """Raises KeyError, TypeError or ValueError for a record of another shape."""
        core, memory = data["core"], data["memory"]
        if not isinstance(core, list) or not isinstance(memory, list):
            raise TypeError("core and memory must be lists of device IDs")
        return cls(
            core=tuple(_text(i) for i in core),
            memory=tuple(_text(i) for i in memory),
            cards=tuple(int(c) for c in data["cards"]),
            created=float(data["created"]),
            key=str(data["key"]),
            verified=bool(data.get("verified", False)),
        )


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"device ID {value!r} is not a string")
    return value


WHOLE_CORE_PAIR_S = 0.5
"""How long whole cards' core waits for a memory call. Whole cards come without memory now, and
while a half is pending its cards' memory is listed Healthy, which the scheduler would count:
kubelet makes a container's second call within milliseconds, so a moment is enough for pods that
still carry memory."""

ADOPTED = 0.0
"""``Allocation.created`` of a container learnt from PodResources: old enough to be freed."""


@dataclass(frozen=True, slots=True)
class CardUsage:
    card: Card
    blocks: int
    core_used: int
    memory_used: int
    healthy: bool
    reason: str


@dataclass(frozen=True, slots=True)
class Reconciled:
    """What one reconciliation changed."""

    freed: list[Allocation]
    adopted: list[Allocation]
    unconfirmed: int  # allocations the listing missed, kept until a second listing agrees


class Allocator:
    def __init__(
        self,
        cards: Iterable[Card],
        *,
        pair_window_s: float = 5.0,
        clock: Clock = time.monotonic,
        wall: Clock = time.time,
    ) -> None:
        self.cards = {c.index: c for c in cards}
        self.blocks = {i: card_blocks(c.memory_mib) for i, c in self.cards.items()}
        self._wall = wall
        self._clock = clock
        self.pairing = Pairing(pair_window_s, clock)
        self._health: dict[int, tuple[bool, str]] = {i: (True, "") for i in self.cards}
        self._allocations: dict[str, Allocation] = {}
        self._owner: dict[str, str] = {}  # device ID -> allocation key
        # card -> kind -> allocated numbers, kept in step with _owner (read on every list)
        self._in_use: dict[int, dict[Kind, set[int]]] = {
            i: {Kind.CORE: set(), Kind.MEMORY: set()} for i in self.cards
        }
        # allocation key -> when a listing first missed it (wall clock of that listing)
        self._missing: dict[str, float] = {}
        totals = {Kind.CORE: {i: CORE_PER_CARD for i in self.cards}, Kind.MEMORY: self.blocks}
        self._lists = ListingCache(totals, {i: c.numa_node for i, c in self.cards.items()})
        self._open: int | None = None  # the one partly used card advertised (placement)
        self._cond = threading.Condition()
        self.version = 0

    @property
    def pair_window_s(self) -> float:
        return self.pairing.window_s

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
                left = self.pairing.seconds_left()
                if left is not None:
                    remaining = min(remaining, max(left, 0.001))
                self._cond.wait(remaining)

    def _changed(self) -> None:
        self._open = placement.open_partial_card(
            self._snapshot().values(), self._open, keep=self.pairing.pending is not None
        )
        self.version += 1
        self._cond.notify_all()

    def _expire_half(self) -> None:
        if self.pairing.expire():
            self._changed()

    def allocations(self) -> list[Allocation]:
        with self._cond:
            return list(self._allocations.values())

    def usage(self) -> list[CardUsage]:
        with self._cond:
            return [
                CardUsage(
                    card=card,
                    blocks=self.blocks[i],
                    core_used=len(self._in_use[i][Kind.CORE]),
                    memory_used=len(self._in_use[i][Kind.MEMORY]),
                    healthy=self._health[i][0],
                    reason=self._health[i][1],
                )
                for i, card in sorted(self.cards.items())
            ]

    def _snapshot(self) -> dict[int, placement.CardState]:
        """The cards as placement sees them. Lock held."""
        return {
            i: placement.CardState(
                index=i,
                blocks=self.blocks[i],
                core_used=len(self._in_use[i][Kind.CORE]),
                memory_used=len(self._in_use[i][Kind.MEMORY]),
                healthy=self._health[i][0],
                numa_node=card.numa_node,
            )
            for i, card in self.cards.items()
        }

    def _pending(self) -> placement.Pending | None:
        half = self.pairing.pending
        return None if half is None else placement.Pending(half.kind, half.cards)

    def _partner(self, kind: Kind, size: int, cards: frozenset[int] | None = None) -> Half | None:
        """The pending half that a call of ``kind`` for ``size`` IDs (on ``cards``, once
        known) completes, or None. Lock held.

        A half of whole cards' core pairs only with all of those cards' memory: whole cards
        come without memory now, so another container's memory call after one is no partner,
        and pairing it would put that container on the whole cards' card.
        """
        half = self.pairing.partner_of(kind)
        if half is None or half.kind is not Kind.CORE or half.size % CORE_PER_CARD:
            return half
        whole_memory = sum(self.blocks[c] for c in half.cards)
        if size == whole_memory and (cards is None or cards == half.cards):
            return half
        self.pairing.end()  # its container had no memory: this call is another container's
        self._changed()
        return None

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

    def devices(self, kind: Kind) -> list[ListedDevice]:
        """The complete ListAndWatch list for one resource, with the placement rules applied."""
        return [device for card in self.listing(kind)[1] for device in card]

    def listing(self, kind: Kind) -> tuple[object, list[tuple[ListedDevice, ...]]]:
        """A signature of the device list and the list itself per card, from one snapshot.

        Equal signatures mean equal lists (ListAndWatch skips identical resends). A card's
        tuple is the same object for as long as that card's state holds (see ``listing``).
        """
        with self._cond:
            self._expire_half()
            shown = placement.advertised(
                self._snapshot().values(), kind, open_card=self._open, pending=self._pending()
            )
            total = CORE_PER_CARD if kind is Kind.CORE else 0
            states = tuple(
                (
                    i,
                    CardListState(
                        self._health[i][0],
                        # a card with nothing free lists the same either way: one state
                        None
                        if i in shown or len(used) == (total or self.blocks[i])
                        else frozenset(used),
                    ),
                )
                for i in sorted(self.cards)
                for used in (self._in_use[i][kind],)
            )
            return states, self._lists.lists(kind, states)

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
            with self._cond:
                # Refused, but what kubelet handed out is free all the same: list it so at
                # once, and the Node's allocatable follows, rather than at the next reading.
                if self._release_reassigned(ids):
                    self._changed()
            self._abandon_half(kind, len(ids))
            raise
        cards = frozenset(by_card)
        with self._cond:
            self._expire_half()
            self._release_reassigned(ids)
            half = self._partner(kind, len(ids), cards)
            if half is not None and half.key in self._allocations:
                self.pairing.end(second_size=len(ids))
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
                partner.verified = False  # what PodResources confirmed was the first half
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
            whole_core = kind is Kind.CORE and len(ids) == CORE_PER_CARD * len(cards)
            self.pairing.begin(
                kind,
                cards,
                allocation.key,
                len(ids),
                window_s=WHOLE_CORE_PAIR_S if whole_core else None,
            )
            self._changed()
            return allocation

    def _release_reassigned(self, ids: Iterable[str], keep: Collection[str] = ()) -> bool:
        """Drop the allocations of containers whose IDs kubelet hands out as free; whether any
        was dropped. Lock held.

        kubelet is the authority on what is free: it offers and assigns only devices of pods it
        no longer runs (and an init container's, which its app containers reuse: ``keep``), and
        it may do so before the reconciler has read PodResources again.
        """
        stale = {self._owner[d] for d in ids if d in self._owner and d not in keep}
        for key in stale:
            self._drop(key, why="kubelet reassigned its devices")
        return bool(stale)

    def _abandon_half(self, kind: Kind, size: int) -> None:
        """The container's second Allocate failed: kubelet rejects the pod and frees its first."""
        with self._cond:
            self._expire_half()
            half = self.pairing.partner_of(kind)
            if half is not None:
                self.pairing.end(second_size=size)
                self._drop(half.key, why="partner allocation failed")
                self._changed()

    def _add(self, allocation: Allocation) -> None:
        self._allocations[allocation.key] = allocation
        for device in allocation.ids():
            self._own(device, allocation.key)

    def _drop(self, key: str, *, why: str) -> None:
        allocation = self._allocations.pop(key, None)
        self._missing.pop(key, None)
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
        available, must_include = list(available), list(must_include)
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
        with self._cond:  # one snapshot for the whole decision
            self._expire_half()
            # An ended container's IDs offered as free: its card has room again, and this
            # container may fit there, where the plugin's own records would have refused it.
            if self._release_reassigned(available, keep=set(must_include)):
                self._changed()
            cards = self._snapshot()
            self._partner(kind, size)
            pending = self._pending()
            other_size = self.pairing.expected_other(kind, size) if pending is None else None
            allowed = placement.advertised(
                cards.values(), kind, open_card=self._open
            ) & placement.advertised(cards.values(), placement.other(kind), open_card=self._open)
        chosen = placement.choose_cards(
            kind,
            size,
            {c: len(n) for c, n in free.items()},
            cards,
            must=set(must),
            allowed=allowed,
            pending=pending,
            other_size=other_size,
        )
        picked = placement.pick_ids(kind, size, chosen, free=free, must=must, cards=cards)
        return [str(DeviceId(card, kind, n)) for card, n in picked]

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
        known = self.find(Kind.CORE, core) if core else self.find(Kind.MEMORY, memory)
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
            allocation = Allocation(
                core=tuple(core),
                memory=tuple(memory),
                cards=tuple(sorted(cards)),
                created=self._wall(),
            )
            self._add(allocation)
            self._changed()
            return allocation

    def reconcile(
        self,
        listed: Iterable[tuple[Collection[str], Collection[str]]],
        listed_at: float,
        *,
        grace_s: float,
        confirm_s: float,
        may_free: bool = True,
    ) -> Reconciled:
        """Align with PodResources ``List`` (core IDs, memory IDs per container).

        Frees allocations none of whose IDs are listed, once a listing at least ``confirm_s``
        after the first one that missed them misses them too (never younger than ``grace_s`` at
        the time of the listing: an Allocate can race the List; never when ``may_free`` is
        false). Adopts listed containers that are unknown.

        It runs every pass over a full node (thousands of IDs) while RPCs wait for the
        interpreter lock, so the common case, a container listed exactly as recorded, is
        settled with set operations that run per ID in C, not in Python bytecode.
        """
        containers = [(frozenset(c), frozenset(m)) for c, m in listed if c or m]
        listed_ids: set[str] = set()
        for core, memory in containers:
            listed_ids |= core
            listed_ids |= memory
        freed: list[Allocation] = []
        adopted: list[Allocation] = []
        with self._cond:
            for key, allocation in list(self._allocations.items()):
                if not listed_ids.isdisjoint(allocation.core) or not listed_ids.isdisjoint(
                    allocation.memory
                ):
                    self._missing.pop(key, None)
                    continue
                if allocation.created > listed_at - grace_s:
                    continue
                if not may_free:  # a listing that cannot be believed confirms nothing either
                    self._missing.pop(key, None)
                    continue
                first_missed = self._missing.setdefault(key, listed_at)
                if listed_at - first_missed < confirm_s:
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
                allocation = Allocation(
                    core=tuple(sorted(core)),
                    memory=tuple(sorted(memory)),
                    cards=tuple(sorted(cards)),
                    created=ADOPTED,
                )
                self._add(allocation)
                adopted.append(allocation)
            if freed or adopted:  # a quiet pass wakes no ListAndWatch stream
                self._changed()
            return Reconciled(freed, adopted, len(self._missing))

    def restore(self, allocations: Iterable[Allocation]) -> None:
        with self._cond:
            for allocation in allocations:
                if all(DeviceId.parse(i).card in self.cards for i in allocation.ids()):
                    self._add(allocation)
            self._changed()
