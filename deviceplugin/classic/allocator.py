"""What this node holds: cards, their health, and which container holds what on which card.

One lock guards all of it; the gRPC handlers, the health thread and the reconciler call in from
their own threads. Every change bumps ``version`` and wakes ListAndWatch streams, which then send
the complete list again (kubelet replaces its view with each message).

**Device IDs are counts, the ledger says where.** kubelet picks a container's IDs per resource
from what it believes free and may pick any of them, so an ID names no card. Each container is
an ``Allocation``: the IDs kubelet gave it (which identify it: IDs are exclusive on a node) and
the card(s) the plugin placed it on, from its own per-card ledger, once both of its amounts are
known (the second of its two Allocate calls; whole cards, which come without memory, at the
first). A container that no card can host at that moment (capacity kubelet counted free an
instant before the plugin learnt of it, see ``docs/device-plugin.md``) is recorded *waiting*:
its Allocate still succeeds, because the card reaches the container only at PreStartContainer
(through CDI), and it is placed as soon as a card can host it.

The allocator delegates policy to units that hold no lock of their own: the card a container
gets and how much a node offers (``placement``, pure functions over a snapshot taken here), the
pairing of a container's two Allocate calls (``pairing``) and the ListAndWatch lists
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
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from core.units import CORE_PER_CARD, card_blocks
from deviceplugin.classic import placement
from deviceplugin.classic.ids import DeviceId, DeviceIdError, Kind
from deviceplugin.classic.listing import GroupState, ListedDevice, ListingCache
from deviceplugin.classic.pairing import Clock, Pairing
from deviceplugin.shared.inventory import Card

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
    cards: tuple[int, ...]  # where the plugin placed it; () while it is not placed
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
    def whole_cards(self) -> int:
        """How many whole cards the container asks for (core in hundreds); 0 for a share."""
        n = len(self.core)
        return n // CORE_PER_CARD if n and n % CORE_PER_CARD == 0 else 0

    @property
    def whole_cards_only(self) -> bool:
        """Whole cards admitted without memory: all of each card is theirs."""
        return bool(self.whole_cards) and not self.memory

    @property
    def placeable(self) -> bool:
        """Both amounts known and valid: whole cards, or a share with core and memory."""
        return bool(self.whole_cards) or (0 < len(self.core) < CORE_PER_CARD and bool(self.memory))

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
"""How long whole cards' core waits for a memory call. Whole cards come without memory now;
kubelet makes a container's second call within milliseconds, so a moment is enough for pods
that still carry memory."""

ADOPTED = 0.0
"""``Allocation.created`` of a container learnt from PodResources: old enough to be freed."""

SETTLE_S = 2.0
"""How long the number of Healthy IDs of a resource is kept from falling after a change that is
neither kubelet's own allocation nor a card failing: in the Node's allocatable for this long,
in kubelet's lists for twice as long.

kube-scheduler decides by the Node's allocatable, which follows the lists a moment later (the
plugin writes it within milliseconds, kubelet at its status period), and kubelet admits each
pod the scheduler bound twice over: by its own count of the lists (device manager) and by the
Node's allocatable against the requests of the pods it runs, including ones it is still
stopping (its predicate check). A change can hide capacity both counted free: an ended
container's IDs released onto a card that is not offered, a share placed on an entirely free
card that hides the open card's rest. Had the lists or the Node's figure shrunk at once,
kubelet refused pods the scheduler had bound by the older figure (on the real cluster:
"requested 200, available 170"; "OutOffracgpu.io/memory ... used: 201, capacity: 178"). Kept,
such pods are admitted, placed, or wait for a card if none can host them
(``docs/device-plugin.md``). The lists keep the count longer than the Node, so that a pod the
scheduler bound at the end of the Node's moment still finds it in kubelet's count."""


@dataclass(slots=True)
class _Floor:
    """Healthy IDs of a resource kept listed at least, for a moment (``SETTLE_S``)."""

    count: int
    node_until: float  # in the Node's allocatable until then (monotonic)
    lists_until: float  # in kubelet's lists until then
    node_ended: bool = False  # the Node's moment has been noted (the writer woken)


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
        settle_s: float = SETTLE_S,
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
        self._unplaced: set[str] = set()  # keys of allocations on no card yet
        # (kind, ID group) -> allocated numbers, kept in step with _owner (read on every list)
        self._owned: dict[tuple[Kind, int], set[int]] = {
            (kind, i): set() for kind in Kind for i in self.cards
        }
        # kind -> the free IDs listed Healthy, as (group, number): kept stable (``listing``)
        self._shown: dict[tuple[Kind, int], set[int]] = {
            (kind, i): set() for kind in Kind for i in self.cards
        }
        self._shown_count: dict[Kind, int] = dict.fromkeys(Kind, 0)
        # (kind, group) -> its last state, and the groups whose IDs changed since (listing)
        self._states: dict[tuple[Kind, int], GroupState] = {}
        self._dirty: set[tuple[Kind, int]] = {(kind, i) for kind in Kind for i in self.cards}
        # card -> [core, memory] the placed allocations hold there (the ledger)
        self._used: dict[int, list[int]] = {i: [0, 0] for i in self.cards}
        # allocation key -> when a listing first missed it (wall clock of that listing)
        self._missing: dict[str, float] = {}
        totals = {Kind.CORE: {i: CORE_PER_CARD for i in self.cards}, Kind.MEMORY: self.blocks}
        self._lists = ListingCache(totals)
        self._open: int | None = None  # the one partly used card offered (placement)
        self._settle_s = settle_s
        self._floor: dict[Kind, _Floor] = {}  # see SETTLE_S
        self._listed: dict[Kind, int] = dict.fromkeys(Kind, 0)  # Healthy at the last change
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
                self._expire_floors()
                if self.version != seen:
                    return self.version
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return self.version
                left = self.pairing.seconds_left()
                if left is not None:
                    remaining = min(remaining, max(left, 0.001))
                for floor in self._floor.values():
                    until = floor.lists_until if floor.node_ended else floor.node_until
                    remaining = min(remaining, max(until - self._clock(), 0.001))
                self._cond.wait(remaining)

    def _changed(self, *, settle: bool = True, drop_floors: bool = False) -> None:
        """Place what waits if it now fits, choose the open card, keep the lists from shrinking
        for a moment (``SETTLE_S``; ``settle`` false: a moment ended, ``drop_floors``: a card
        failed, withdrawn at once), wake the streams. Lock held."""
        self._place_waiting()
        cards = list(self._snapshot().values())
        self._open = placement.open_partial_card(
            cards, self._open, keep=self.pairing.pending is not None
        )
        now = self._clock()
        waiting = bool(self._waiting())
        for kind in Kind:
            owned = self._owned_count(kind)
            offered_now = self._offered_now(kind, cards=cards, waiting=waiting)
            listed = owned + offered_now
            if drop_floors:
                self._floor.pop(kind, None)
            elif settle and listed < self._listed[kind] and self._settle_s > 0:
                before = self._floor.get(kind)
                keep = max(self._listed[kind], before.count if before else 0)
                self._floor[kind] = _Floor(keep, now + self._settle_s, now + 2 * self._settle_s)
            self._listed[kind] = owned + self._offered(kind, now_offered=offered_now)
        self.version += 1
        self._cond.notify_all()

    def _expire_floors(self) -> None:
        """Wake the streams and the Node's writer when a floor's moment ends, on the Node or
        in the lists. Lock held."""
        now = self._clock()
        ended = False
        for kind, floor in list(self._floor.items()):
            if floor.lists_until <= now:
                del self._floor[kind]
                ended = True
            elif not floor.node_ended and floor.node_until <= now:
                floor.node_ended = True
                ended = True
        if ended:
            self._changed(settle=False)

    def keeping(self) -> bool:
        """Whether the lists keep capacity a change hid, for either resource (``SETTLE_S``)."""
        with self._cond:
            return bool(self._floor)

    def settling(self, kind: Kind) -> bool:
        """Whether more IDs of ``kind`` are listed than offered, for a moment (``SETTLE_S``)."""
        with self._cond:
            return self._offered(kind) > self._offered_now(kind)

    def over_offered(self, kind: Kind) -> int:
        """How many more free IDs of ``kind`` kubelet's lists show than the Node's allocatable
        should: after the Node's moment of a floor, until the lists' moment ends."""
        with self._cond:
            return self._offered(kind) - self._offered(kind, node=True)

    def _expire_half(self) -> None:
        if self.pairing.expire():
            self._changed()

    def allocations(self) -> list[Allocation]:
        with self._cond:
            return list(self._allocations.values())

    def waiting(self) -> list[Allocation]:
        """Containers admitted by kubelet that no card could host yet, oldest first."""
        with self._cond:
            return self._waiting()

    def _waiting(self) -> list[Allocation]:
        pending = self.pairing.pending
        found = [
            a
            for key in self._unplaced
            if (pending is None or pending.key != key)
            for a in (self._allocations[key],)
            if a.placeable
        ]
        return sorted(found, key=lambda a: a.created) if len(found) > 1 else found

    def usage(self) -> list[CardUsage]:
        with self._cond:
            return [
                CardUsage(
                    card=card,
                    blocks=self.blocks[i],
                    core_used=self._used[i][0],
                    memory_used=self._used[i][1],
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
                core_used=self._used[i][0],
                memory_used=self._used[i][1],
                healthy=self._health[i][0],
                numa_node=card.numa_node,
            )
            for i, card in self.cards.items()
        }

    def _charge(self, allocation: Allocation, sign: int) -> None:
        """Add (1) or remove (-1) what a placed allocation holds on its cards. Lock held."""
        if allocation.whole_cards:
            for card in allocation.cards:
                self._used[card][0] += sign * CORE_PER_CARD
                self._used[card][1] += sign * self.blocks[card]
        elif allocation.cards:
            card = allocation.cards[0]
            self._used[card][0] += sign * len(allocation.core)
            self._used[card][1] += sign * len(allocation.memory)

    def _place(self, allocation: Allocation) -> bool:
        """Give an unplaced allocation its card(s) if the ledger has room. Lock held."""
        if allocation.cards or not allocation.placeable:
            return bool(allocation.cards)
        chosen = placement.place(self._snapshot(), len(allocation.core), len(allocation.memory))
        if not chosen:
            return False
        allocation.cards = tuple(sorted(chosen))
        self._unplaced.discard(allocation.key)
        self._charge(allocation, 1)
        return True

    def _place_waiting(self) -> None:
        for allocation in self._waiting():
            if self._place(allocation):
                log.info(
                    "waiting container placed",
                    extra={"cards": list(allocation.cards), "dir": allocation.dir_name},
                )

    def _own(self, device: str, key: str) -> None:
        if device not in self._owner:
            parsed = DeviceId.parse(device)
            group = (parsed.kind, parsed.card)
            owned = self._owned.get(group)
            if owned is not None:
                owned.add(parsed.number)
                shown = self._shown[group]
                if parsed.number in shown:  # a shown free ID taken: Healthy either way
                    shown.discard(parsed.number)
                    self._shown_count[parsed.kind] -= 1
                self._dirty.add(group)
        self._owner[device] = key

    def _disown(self, device: str) -> None:
        if self._owner.pop(device, None) is not None:
            parsed = DeviceId.parse(device)
            group = (parsed.kind, parsed.card)
            owned = self._owned.get(group)
            if owned is not None:
                owned.discard(parsed.number)
                self._dirty.add(group)

    def devices(self, kind: Kind) -> list[ListedDevice]:
        """The complete ListAndWatch list for one resource."""
        return [device for group in self.listing(kind)[1] for device in group]

    def offered(self, kind: Kind) -> int:
        """How many free IDs of ``kind`` are listed Healthy now."""
        with self._cond:
            return self._offered(kind)

    def _offered_now(
        self,
        kind: Kind,
        *,
        cards: list[placement.CardState] | None = None,
        waiting: bool | None = None,
    ) -> int:
        """What the ledger offers now, before the settling floor (``cards``, ``waiting``: from
        the caller's snapshot, when it has one)."""
        if self._waiting() if waiting is None else waiting:
            # Admitted containers wait for a card: what frees up is theirs first, and nothing
            # new is invited to this node until they are placed.
            return 0
        if cards is None:
            cards = list(self._snapshot().values())
        offered = placement.offered(cards, kind, open_card=self._open)
        half = self.pairing.pending
        partner = None if half is None else self._allocations.get(half.key)
        if half is not None and half.kind is kind and partner is not None and not partner.cards:
            # The first call's IDs came out of what was offered; the ledger cannot hold them
            # until the container is placed, so they are taken off here.
            offered = max(offered - half.size, 0)
        if half is not None and half.kind is not kind:
            # Between a container's two calls, kubelet counts the second against the IDs it
            # saw Healthy at the first; what that call changed (ended containers released,
            # whole cards placed, another card opened) must not shrink that list meanwhile.
            offered = max(offered, half.hold - self._owned_count(kind))
        return offered

    def _offered(self, kind: Kind, *, node: bool = False, now_offered: int | None = None) -> int:
        """What the lists (``node``: the Node's allocatable) offer: the ledger's offer
        (``now_offered`` when the caller has it), or more while a floor holds."""
        offered = self._offered_now(kind) if now_offered is None else now_offered
        floor = self._floor.get(kind)
        if floor is not None and (floor.node_until if node else floor.lists_until) > self._clock():
            offered = max(offered, floor.count - self._owned_count(kind))
        return offered

    def _owned_count(self, kind: Kind) -> int:
        return sum(len(self._owned[(kind, group)]) for group in self.cards)

    def listing(self, kind: Kind) -> tuple[object, list[tuple[ListedDevice, ...]]]:
        """A signature of the device list and the list itself per ID group, from one snapshot.

        Equal signatures mean equal lists (ListAndWatch skips identical resends). A group's
        tuple is the same object for as long as that group's Healthy IDs hold (see ``listing``).

        Which free IDs are shown Healthy is kept from one listing to the next as far as the
        offer allows (``_shown``): kubelet allocates only Healthy IDs, so an allocation that
        takes what was offered turns shown free IDs into allocated ones, both Healthy, and the
        list does not change at all. Only a change of the offer adds the lowest free IDs or
        drops the highest shown ones.
        """
        with self._cond:
            self._expire_half()
            target = self._offered(kind)
            if self._shown_count[kind] > target:
                self._show_fewer(kind, self._shown_count[kind] - target)
            elif self._shown_count[kind] < target:
                self._show_more(kind, target - self._shown_count[kind])
            sick_cards = {i for i, (ok, _) in self._health.items() if not ok}
            sick_keys = (
                {a.key for a in self._allocations.values() if sick_cards.intersection(a.cards)}
                if sick_cards
                else set()
            )
            states = []
            for group in sorted(self.cards):
                where = (kind, group)
                state = self._states.get(where)
                if state is None or where in self._dirty or sick_keys:
                    owned = self._owned[where]
                    if sick_keys:
                        owned = {
                            n
                            for n in owned
                            if self._owner.get(str(DeviceId(group, kind, n))) not in sick_keys
                        }
                    state = GroupState(frozenset(owned | self._shown[where]))
                    if state != self._states.get(where):
                        self._states[where] = state
                    else:
                        state = self._states[where]
                    self._dirty.discard(where)
                states.append((group, state))
            signature = tuple(states)
            return signature, self._lists.lists(kind, states)

    def _show_fewer(self, kind: Kind, count: int) -> None:
        """Stop showing ``count`` free IDs of ``kind``, the highest first. Lock held."""
        for group in sorted(self.cards, reverse=True):
            shown = self._shown[(kind, group)]
            while shown and count:
                shown.discard(max(shown))
                count -= 1
                self._shown_count[kind] -= 1
                self._dirty.add((kind, group))
            if not count:
                return

    def _show_more(self, kind: Kind, count: int) -> None:
        """Show ``count`` more free IDs of ``kind``, the lowest first. Lock held."""
        for group in sorted(self.cards):
            owned, shown = self._owned[(kind, group)], self._shown[(kind, group)]
            total = CORE_PER_CARD if kind is Kind.CORE else self.blocks[group]
            if len(owned) + len(shown) >= total:
                continue
            for number in range(total):
                if count == 0:
                    return
                if number not in owned and number not in shown:
                    shown.add(number)
                    count -= 1
                    self._shown_count[kind] += 1
                    self._dirty.add((kind, group))

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
            self._changed(drop_floors=not healthy)
            return True

    def is_healthy(self, card: int) -> bool:
        with self._cond:
            return self._health.get(card, (False, ""))[0]

    # ---- Allocate ----------------------------------------------------------------------

    def _known(self, kind: Kind, text: str) -> bool:
        """Whether ``text`` is an ID this plugin lists for ``kind``."""
        try:
            parsed = DeviceId.parse(text)
        except DeviceIdError:
            return False
        total = CORE_PER_CARD if kind is Kind.CORE else self.blocks.get(parsed.card, 0)
        return parsed.kind is kind and parsed.card in self.cards and parsed.number < total

    def _check(self, kind: Kind, ids: Iterable[str], resource: str) -> None:
        """That every ID is one this plugin lists for ``kind``, once; AllocationError if not."""
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
                raise AllocationError(f"{resource}: device ID {text!r} is unknown on this node")
        if not seen:
            raise AllocationError(f"{resource}: the request holds no device IDs")
        if kind is Kind.CORE and len(seen) > CORE_PER_CARD and len(seen) % CORE_PER_CARD:
            raise AllocationError(
                f"{resource}: {len(seen)} is neither a share of one card (1-{CORE_PER_CARD - 1}) "
                f"nor whole cards (a multiple of {CORE_PER_CARD}); the fracgpu admission webhook "
                f"sizes requests, so create the pod through it"
            )
        if kind is Kind.CORE and len(seen) // CORE_PER_CARD > len(self.cards):
            raise AllocationError(
                f"{resource}: {len(seen) // CORE_PER_CARD} whole cards asked for, this node has "
                f"{len(self.cards)}"
            )

    def allocate(self, kind: Kind, ids: list[str], resource: str) -> Allocation:
        """Record one Allocate container request; raise AllocationError if it can never work.

        The container is placed when both of its amounts are known (or at once for whole
        cards); one that no card can host yet is kept waiting, never refused.
        """
        try:
            self._check(kind, ids, resource)
        except AllocationError:
            with self._cond:
                # Refused, but what kubelet handed out is free all the same: list it so at
                # once, and the Node's allocatable follows, rather than at the next reading.
                self._abandon_half(kind)
                if self._release_reassigned(ids):
                    self._changed()
            raise
        with self._cond:
            self._expire_half()
            other = placement.other(kind)
            listed_other = self._owned_count(other) + self._offered(other)
            self._release_reassigned(ids)
            half = self.pairing.partner_of(kind)
            partner = None if half is None else self._allocations.get(half.key)
            if partner is not None and partner.whole_cards and kind is Kind.MEMORY:
                # Whole cards come without memory now: a memory call after them pairs only if
                # it is all of their cards' memory; else it is the next container's first.
                whole_memory = sum(self.blocks[c] for c in partner.cards) or (
                    partner.whole_cards * max(self.blocks.values())
                )
                if len(ids) != whole_memory:
                    partner = None
                    self.pairing.end()
            if partner is not None:
                self.pairing.end()
                if kind is Kind.CORE:
                    partner.core = tuple(ids)
                else:
                    partner.memory = tuple(ids)
                partner.verified = False  # what PodResources confirmed was the first half
                for device in ids:
                    self._own(device, partner.key)
                self._place(partner)
                self._changed()
                return partner
            allocation = Allocation(
                core=tuple(ids) if kind is Kind.CORE else (),
                memory=tuple(ids) if kind is Kind.MEMORY else (),
                cards=(),
                created=self._wall(),
            )
            self._add(allocation)
            if allocation.whole_cards:
                self._place(allocation)
            self.pairing.begin(
                kind,
                allocation.key,
                len(ids),
                hold=listed_other,
                window_s=WHOLE_CORE_PAIR_S if allocation.whole_cards else None,
            )
            self._changed()
            return allocation

    def forget(self, allocation: Allocation, *, why: str) -> None:
        """Drop an allocation whose Allocate was refused (kubelet rejects the pod)."""
        with self._cond:
            self._drop(allocation.key, why=why)
            self._changed()

    def _release_reassigned(self, ids: Iterable[str], keep: Collection[str] = ()) -> bool:
        """Drop the allocations of containers whose IDs kubelet hands out as free; whether any
        was dropped. Lock held.

        kubelet is the authority on what is free: it assigns only devices of pods it no longer
        runs (and an init container's, which its app containers reuse: ``keep``), and it may do
        so before the reconciler has read PodResources again.
        """
        stale = {self._owner[d] for d in ids if d in self._owner and d not in keep}
        for key in stale:
            self._drop(key, why="kubelet reassigned its devices")
        return bool(stale)

    def _abandon_half(self, kind: Kind) -> None:
        """The container's second Allocate failed: kubelet rejects the pod and frees its first.
        Lock held."""
        self._expire_half()
        half = self.pairing.partner_of(kind)
        if half is not None:
            self.pairing.end()
            self._drop(half.key, why="partner allocation failed")
            self._changed()

    def _add(self, allocation: Allocation) -> None:
        self._allocations[allocation.key] = allocation
        if not allocation.cards:
            self._unplaced.add(allocation.key)
        for device in allocation.ids():
            self._own(device, allocation.key)
        self._charge(allocation, 1)

    def _drop(self, key: str, *, why: str) -> None:
        allocation = self._allocations.pop(key, None)
        self._missing.pop(key, None)
        self._unplaced.discard(key)
        if allocation is None:
            return
        self._charge(allocation, -1)
        for device in allocation.ids():
            if self._owner.get(device) == key:
                self._disown(device)
        half = self.pairing.pending
        if half is not None and half.key == key:
            self.pairing.end()
        log.info(
            "allocation freed",
            extra={"cards": list(allocation.cards), "dir": allocation.dir_name, "why": why},
        )

    # ---- GetPreferredAllocation --------------------------------------------------------

    def preferred(
        self, kind: Kind, available: Iterable[str], must_include: Iterable[str], size: int
    ) -> list[str]:
        """The IDs this container should get: any will do (IDs are counts), so the ones kubelet
        must include and then the lowest it offers. An ended container's IDs offered as free
        are released at once."""
        available = sorted(i for i in available if self._known(kind, i))
        must = list(must_include)
        if not all(self._known(kind, i) for i in must):
            return []
        with self._cond:
            if self._release_reassigned(available, keep=set(must)):
                self._changed()
        rest = [i for i in available if i not in set(must)]
        chosen = must + rest[: max(size - len(must), 0)]
        return chosen if len(chosen) == size else []

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

    def adopt(
        self, core: list[str], memory: list[str], cards: Collection[int] | None = None
    ) -> Allocation:
        """Record a container learnt from PodResources (PreStartContainer, restart recovery),
        on ``cards`` when its limits file names them, else where the ledger has room."""
        with self._cond:
            for device in [*core, *memory]:
                stale = self._owner.get(device)
                if stale is not None:
                    self._drop(stale, why="superseded by PodResources")
            allocation = self._adopted(core, memory, cards, created=self._wall())
            self._changed()
            return allocation

    def _adopted(
        self,
        core: Iterable[str],
        memory: Iterable[str],
        cards: Collection[int] | None,
        *,
        created: float,
    ) -> Allocation:
        allocation = Allocation(
            core=tuple(sorted(core)),
            memory=tuple(sorted(memory)),
            cards=tuple(sorted(c for c in cards or () if c in self.cards)),
            created=created,
        )
        self._add(allocation)
        self._place(allocation)
        return allocation

    def reconcile(
        self,
        listed: Iterable[tuple[Collection[str], Collection[str]]],
        listed_at: float,
        *,
        grace_s: float,
        confirm_s: float,
        may_free: bool = True,
        cards_of: Callable[[Collection[str]], Collection[int] | None] | None = None,
    ) -> Reconciled:
        """Align with PodResources ``List`` (core IDs, memory IDs per container).

        Frees allocations none of whose IDs are listed, once a listing at least ``confirm_s``
        after the first one that missed them misses them too (never younger than ``grace_s`` at
        the time of the listing: an Allocate can race the List; never when ``may_free`` is
        false). Adopts listed containers that are unknown, on the cards ``cards_of`` (their
        core IDs) says they run on.

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
                hint = cards_of(core) if cards_of is not None and core else None
                adopted.append(self._adopted(core, memory, hint, created=ADOPTED))
            if freed or adopted:  # a quiet pass wakes no ListAndWatch stream
                self._changed()
            return Reconciled(freed, adopted, len(self._missing))

    def restore(self, allocations: Iterable[Allocation]) -> None:
        with self._cond:
            for allocation in allocations:
                if all(DeviceId.parse(i).card in self.cards for i in allocation.ids()):
                    if not all(c in self.cards for c in allocation.cards):
                        allocation.cards = ()
                    self._add(allocation)
                    self._place(allocation)
            self._changed()
