"""What this node holds, behind one lock: the allocator coordinates the units that say it.

The gRPC handlers, the health thread and the reconciler call in from their own threads; one lock
guards every unit below, none of which has a lock of its own. Every change bumps ``version`` and
wakes ListAndWatch streams, which then send the complete list again (kubelet replaces its view
with each message).

**Device IDs are counts, the ledger says where.** kubelet picks a container's IDs per resource
from what it believes free and may pick any of them, so an ID names no card. Each container is
an ``Allocation``: the IDs kubelet gave it (which identify it: IDs are exclusive on a node) and
the card(s) the plugin placed it on, from its own per-card ledger, once both of its amounts are
known (the second of its two Allocate calls; whole cards, which come without memory, at the
first). A container that no card can host at that moment (capacity kubelet counted free an
instant before the plugin learnt of it, see ``docs/device-plugin.md``) is recorded *waiting*:
its Allocate still succeeds, because the card reaches the container only at PreStartContainer
(through CDI), and it is placed as soon as a card can host it.

The units: the records (``allocation``) and the IDs a request may hold (``validate``); who holds
what on which card and each card's health (``ledger``); the card a container gets and how much a
node offers (``placement``, pure functions over the ledger's snapshot); the pairing of a
container's two Allocate calls (``pairing``); the moment the lists are kept from shrinking
(``settling``); the offer those make together (``offer``); which IDs the ListAndWatch lists
show Healthy (``shown``, ``listing``); and the alignment with kubelet's PodResources
(``reconciliation``). In the extender placement mode a subclass (``directed``) replaces who
chooses the card and what is offered.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable

from core.units import card_blocks
from deviceplugin.classic import placement, reconciliation, validate
from deviceplugin.classic.allocation import Allocation, AllocationError
from deviceplugin.classic.fulloffer import FullOffer
from deviceplugin.classic.ids import Kind
from deviceplugin.classic.ledger import CardUsage, Ledger
from deviceplugin.classic.listing import ListedDevice
from deviceplugin.classic.offer import Offer
from deviceplugin.classic.pairing import WHOLE_CORE_PAIR_S, Clock, Pairing
from deviceplugin.classic.reconciliation import Listing, Reconciled
from deviceplugin.classic.settling import SETTLE_S
from deviceplugin.classic.shown import ShownIds
from deviceplugin.shared.inventory import Card

__all__ = ["Allocator"]


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
        self.shown = ShownIds(self.blocks)
        self.ledger, self.offer = self._units(settle_s, clock)
        self._cond = threading.Condition()
        self.version = 0

    def _units(self, settle_s: float, clock: Clock) -> tuple[Ledger, Offer | FullOffer]:
        """The mode's units: the node's best fit, what one card can host (see ``directed``)."""
        ledger = Ledger(self.cards, self.blocks, self.shown)
        return ledger, Offer(ledger, self.shown, self.pairing, settle_s, clock)

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
                if self.offer.floors.expire():
                    self._changed(settle=False)
                if self.version != seen:
                    return self.version
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return self.version
                left = self.pairing.seconds_left()
                if left is not None:
                    remaining = min(remaining, max(left, 0.001))
                self._cond.wait(self.offer.floors.next_end(remaining))

    def _changed(self, *, settle: bool = True, drop_floors: bool = False) -> None:
        """Place what waits if it now fits, choose the open card, keep the lists from shrinking
        for a moment (``SETTLE_S``; ``settle`` false: a moment ended, ``drop_floors``: a card
        failed, withdrawn at once), wake the streams. Lock held."""
        self.ledger.place_waiting(self.pairing.pending_key)
        self.offer.update(settle=settle, drop_floors=drop_floors)
        self.version += 1
        self._cond.notify_all()

    def keeping(self) -> bool:
        """Whether the lists keep capacity a change hid, for either resource (``SETTLE_S``)."""
        with self._cond:
            return bool(self.offer.floors.floors)

    def settling(self, kind: Kind) -> bool:
        """Whether more IDs of ``kind`` are listed than offered, for a moment (``SETTLE_S``)."""
        with self._cond:
            return self.offer.listed(kind) > self.offer.now(kind)

    def over_offered(self, kind: Kind) -> int:
        """How many more free IDs of ``kind`` kubelet's lists show than the Node's allocatable
        should: after the Node's moment of a floor, until the lists' moment ends."""
        with self._cond:
            return self.offer.listed(kind) - self.offer.listed(kind, node=True)

    def _expire_half(self) -> None:
        if self.pairing.expire():
            self._changed()

    def allocations(self) -> list[Allocation]:
        with self._cond:
            return list(self.ledger.allocations.values())

    def waiting(self) -> list[Allocation]:
        """Containers admitted by kubelet that no card could host yet, oldest first."""
        with self._cond:
            return self._waiting()

    def _waiting(self) -> list[Allocation]:
        return self.ledger.waiting(self.pairing.pending_key)

    def usage(self) -> list[CardUsage]:
        with self._cond:
            return self.ledger.usage()

    # ---- ListAndWatch ------------------------------------------------------------------

    def devices(self, kind: Kind) -> list[ListedDevice]:
        """The complete ListAndWatch list for one resource."""
        return [device for group in self.listing(kind)[1] for device in group]

    def offered(self, kind: Kind) -> int:
        """How many free IDs of ``kind`` are listed Healthy now."""
        with self._cond:
            return self.offer.listed(kind)

    def listing(self, kind: Kind) -> tuple[object, list[tuple[ListedDevice, ...]]]:
        """A signature of the device list and the list itself per ID group, from one snapshot.

        Equal signatures mean equal lists (ListAndWatch skips identical resends); see ``shown``
        for which free IDs are shown.
        """
        with self._cond:
            self._expire_half()
            target = self.offer.listed(kind)
            return self.shown.listing(
                kind, target, owner=self.ledger.owner, sick_keys=self.ledger.sick_keys()
            )

    # ---- health ------------------------------------------------------------------------

    def set_health(self, card: int, healthy: bool, reason: str = "") -> bool:
        """Record a card's health; True when it changed (ListAndWatch streams then resend)."""
        with self._cond:
            if not self.ledger.set_health(card, healthy, reason):
                return False
            self._changed(drop_floors=not healthy)
            return True

    def is_healthy(self, card: int) -> bool:
        with self._cond:
            return self.ledger.health.get(card, (False, ""))[0]

    # ---- Allocate ----------------------------------------------------------------------

    def allocate(self, kind: Kind, ids: list[str], resource: str) -> Allocation:
        """Record one Allocate container request; raise AllocationError if it can never work.

        The container is placed when both of its amounts are known (or at once for whole
        cards); one that no card can host yet is kept waiting, never refused.
        """
        try:
            validate.check(kind, ids, resource, self.blocks)
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
            listed_other = self.shown.owned_count(other) + self.offer.listed(other)
            self._release_reassigned(ids)
            partner = self.pairing.partner(kind, len(ids), self.ledger.allocations, self.blocks)
            if partner is not None:
                self.pairing.end()
                self.ledger.complete(partner, kind, ids)
                self._changed()
                return partner
            allocation = self.ledger.first(kind, ids, created=self._wall())
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
        stale = self.ledger.holders(ids, keep)
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

    def _drop(self, key: str, *, why: str) -> None:
        """Drop an allocation, and the pending half that is its first call. Lock held."""
        self.ledger.drop(key, why=why)
        half = self.pairing.pending
        if half is not None and half.key == key:
            self.pairing.end()

    def _end_dropped_half(self) -> None:
        """A pending half whose allocation is gone ends with it. Lock held."""
        half = self.pairing.pending
        if half is not None and half.key not in self.ledger.allocations:
            self.pairing.end()

    # ---- GetPreferredAllocation --------------------------------------------------------

    def preferred(
        self, kind: Kind, available: Iterable[str], must_include: Iterable[str], size: int
    ) -> list[str]:
        """The IDs this container should get: any will do (IDs are counts), so the ones kubelet
        must include and then the lowest it offers. An ended container's IDs offered as free
        are released at once."""
        available = sorted(i for i in available if validate.known(kind, i, self.blocks))
        must = list(must_include)
        if not all(validate.known(kind, i, self.blocks) for i in must):
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
            return self.ledger.find(ids)

    def verify(self, core: Iterable[str], memory: Iterable[str]) -> Allocation:
        """Record that PodResources lists one container holding exactly these IDs."""
        core, memory = sorted(core), sorted(memory)
        known = self.find(Kind.CORE, core) if core else self.find(Kind.MEMORY, memory)
        with self._cond:
            if (
                known is not None
                and known.key in self.ledger.allocations
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
            for stale in self.ledger.holders([*core, *memory]):
                self._drop(stale, why="superseded by PodResources")
            allocation = self.ledger.adopted(core, memory, cards, created=self._wall())
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
        cards_of: Callable[[Collection[str]], Collection[int] | None] | None = None,
    ) -> Reconciled:
        """Align with PodResources ``List`` (core IDs, memory IDs per container): free what it
        no longer lists, adopt what it lists unknown (``reconciliation.align``)."""
        listing = Listing.of(listed)
        with self._cond:
            result = reconciliation.align(
                self.ledger,
                listing,
                listed_at,
                grace_s=grace_s,
                confirm_s=confirm_s,
                may_free=may_free,
                cards_of=cards_of,
            )
            self._end_dropped_half()
            if result.freed or result.adopted:  # a quiet pass wakes no ListAndWatch stream
                self._changed()
            return result

    def restore(self, allocations: Iterable[Allocation]) -> None:
        with self._cond:
            self.ledger.restore(allocations)
            self._changed()
