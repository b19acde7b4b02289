"""The ledger: which container holds which device IDs, which card(s) it sits on, and what that
leaves on each card; and each card's health.

IDs are counts (see ``placement``), so the ledger, not the IDs, says where a container runs: a
container is charged to its card(s) once it is placed (:meth:`Ledger.place`), and one that no
card can host yet stays *unplaced* (waiting) until one can. Every change of who owns an ID is
passed on to ``shown.ShownIds``, which lists the allocated IDs.

Not thread-safe: the allocator's lock guards it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from core.units import CORE_PER_CARD
from deviceplugin.classic import placement
from deviceplugin.classic.allocation import Allocation
from deviceplugin.classic.ids import DeviceId, Kind
from deviceplugin.classic.shown import ShownIds
from deviceplugin.shared.inventory import Card

# The allocator's logger, as before the ledger was its own module: log filters name it.
log = logging.getLogger("deviceplugin.classic.allocator")

Chooser = Callable[[Mapping[int, placement.CardState], Allocation], list[int]]
"""The card(s) an unplaced container gets on cards as they are now; [] if none (it waits)."""


def best_fit(cards: Mapping[int, placement.CardState], allocation: Allocation) -> list[int]:
    """The node's own choice (``placement.place``): the placement mode ``node``."""
    return placement.place(cards, len(allocation.core), len(allocation.memory))


@dataclass(frozen=True, slots=True)
class CardUsage:
    card: Card
    blocks: int
    core_used: int
    memory_used: int
    healthy: bool
    reason: str


class Ledger:
    def __init__(
        self,
        cards: Mapping[int, Card],
        blocks: Mapping[int, int],
        shown: ShownIds,
        choose: Chooser = best_fit,
    ):
        self.cards = cards
        self._choose = choose
        self.blocks = blocks
        self._shown = shown
        self.health: dict[int, tuple[bool, str]] = {i: (True, "") for i in cards}
        self.allocations: dict[str, Allocation] = {}
        self.owner: dict[str, str] = {}  # device ID -> allocation key
        self.unplaced: set[str] = set()  # keys of allocations on no card yet
        # card -> [core, memory] the placed allocations hold there
        self._used: dict[int, list[int]] = {i: [0, 0] for i in cards}
        # allocation key -> when a listing first missed it (wall clock of that listing)
        self.missing: dict[str, float] = {}

    # ---- records -----------------------------------------------------------------------

    def add(self, allocation: Allocation) -> None:
        self.allocations[allocation.key] = allocation
        if not allocation.cards:
            self.unplaced.add(allocation.key)
        for device in allocation.ids():
            self.own(device, allocation.key)
        self._charge(allocation, 1)

    def drop(self, key: str, *, why: str) -> Allocation | None:
        """Forget an allocation and free what it holds; the one dropped, if it was known."""
        allocation = self.allocations.pop(key, None)
        self.missing.pop(key, None)
        self.unplaced.discard(key)
        if allocation is None:
            return None
        self._charge(allocation, -1)
        for device in allocation.ids():
            if self.owner.get(device) == key:
                self.disown(device)
        log.info(
            "allocation freed",
            extra={"cards": list(allocation.cards), "dir": allocation.dir_name, "why": why},
        )
        return allocation

    def adopted(
        self,
        core: Iterable[str],
        memory: Iterable[str],
        cards: Collection[int] | None,
        *,
        created: float,
    ) -> Allocation:
        """Record a container learnt from elsewhere than Allocate, on ``cards`` when they are
        known (its limits file names them), else where the ledger has room."""
        allocation = Allocation(
            core=tuple(sorted(core)),
            memory=tuple(sorted(memory)),
            cards=tuple(sorted(c for c in cards or () if c in self.cards)),
            created=created,
        )
        self.add(allocation)
        self.place(allocation)
        return allocation

    def first(self, kind: Kind, ids: Sequence[str], *, created: float) -> Allocation:
        """A container's first Allocate call, recorded; whole cards, which need no memory, are
        placed at once."""
        allocation = Allocation(
            core=tuple(ids) if kind is Kind.CORE else (),
            memory=tuple(ids) if kind is Kind.MEMORY else (),
            cards=(),
            created=created,
        )
        self.add(allocation)
        if allocation.whole_cards:
            self.place(allocation)
        return allocation

    def complete(self, allocation: Allocation, kind: Kind, ids: Sequence[str]) -> None:
        """A container's second Allocate call: its other amount; placed if the ledger has room."""
        if kind is Kind.CORE:
            allocation.core = tuple(ids)
        else:
            allocation.memory = tuple(ids)
        allocation.verified = False  # what PodResources confirmed was the first half
        for device in ids:
            self.own(device, allocation.key)
        self.place(allocation)

    def restore(self, allocations: Iterable[Allocation]) -> None:
        """Take the checkpoint's records back: those whose IDs are all on this node's cards, on
        their cards while those are all there, else wherever the ledger has room."""
        for allocation in allocations:
            if all(DeviceId.parse(i).card in self.cards for i in allocation.ids()):
                if not all(c in self.cards for c in allocation.cards):
                    allocation.cards = ()
                self.add(allocation)
                self.place(allocation)

    def holders(self, ids: Iterable[str], keep: Collection[str] = ()) -> list[str]:
        """The allocations that hold any of ``ids`` (but for those in ``keep``), once each, in
        the order of ``ids``."""
        owner = self.owner
        return list(dict.fromkeys(owner[d] for d in ids if d in owner and d not in keep))

    def own(self, device: str, key: str) -> None:
        if device not in self.owner:
            self._shown.take(DeviceId.parse(device))
        self.owner[device] = key

    def disown(self, device: str) -> None:
        if self.owner.pop(device, None) is not None:
            self._shown.release(DeviceId.parse(device))

    def find(self, ids: Iterable[str]) -> Allocation | None:
        """The one allocation that holds all of ``ids``; None if none or several do."""
        keys = {self.owner.get(i) for i in ids}
        if len(keys) != 1 or None in keys:
            return None
        return self.allocations[next(iter(keys))]  # type: ignore[index]

    # ---- cards -------------------------------------------------------------------------

    def _charge(self, allocation: Allocation, sign: int) -> None:
        """Add (1) or remove (-1) what a placed allocation holds on its cards."""
        if allocation.whole_cards:
            for card in allocation.cards:
                self._used[card][0] += sign * CORE_PER_CARD
                self._used[card][1] += sign * self.blocks[card]
        elif allocation.cards:
            card = allocation.cards[0]
            self._used[card][0] += sign * len(allocation.core)
            self._used[card][1] += sign * len(allocation.memory)

    def place(self, allocation: Allocation) -> bool:
        """Give an unplaced allocation its card(s) if the ledger has room."""
        if allocation.cards or not allocation.placeable:
            return bool(allocation.cards)
        chosen = self._choose(self.snapshot(), allocation)
        if not chosen:
            return False
        allocation.cards = tuple(sorted(chosen))
        self.unplaced.discard(allocation.key)
        self._charge(allocation, 1)
        return True

    def waiting(self, pending: str | None) -> list[Allocation]:
        """Containers that no card could host yet, oldest first; ``pending``: the key of a
        container whose second Allocate is still to come (not waiting: it is not complete)."""
        found = [
            a
            for key in self.unplaced
            if pending != key
            for a in (self.allocations[key],)
            if a.placeable
        ]
        return sorted(found, key=lambda a: a.created) if len(found) > 1 else found

    def place_waiting(self, pending: str | None) -> None:
        for allocation in self.waiting(pending):
            if self.place(allocation):
                log.info(
                    "waiting container placed",
                    extra={"cards": list(allocation.cards), "dir": allocation.dir_name},
                )

    def snapshot(self) -> dict[int, placement.CardState]:
        """The cards as placement sees them."""
        return {
            i: placement.CardState(
                index=i,
                blocks=self.blocks[i],
                core_used=self._used[i][0],
                memory_used=self._used[i][1],
                healthy=self.health[i][0],
                numa_node=card.numa_node,
            )
            for i, card in self.cards.items()
        }

    def usage(self) -> list[CardUsage]:
        return [
            CardUsage(
                card=card,
                blocks=self.blocks[i],
                core_used=self._used[i][0],
                memory_used=self._used[i][1],
                healthy=self.health[i][0],
                reason=self.health[i][1],
            )
            for i, card in sorted(self.cards.items())
        ]

    def set_health(self, card: int, healthy: bool, reason: str) -> bool:
        """Record a card's health; True when it changed."""
        if card not in self.health or self.health[card][0] == healthy:
            return False
        self.health[card] = (healthy, reason)
        log.warning(
            "card health changed",
            extra={"card": card, "healthy": healthy, "reason": reason},
        )
        return True

    def sick_keys(self) -> set[str]:
        """The allocations on a card that failed (their IDs are listed Unhealthy)."""
        sick_cards = {i for i, (ok, _) in self.health.items() if not ok}
        if not sick_cards:
            return set()
        return {a.key for a in self.allocations.values() if sick_cards.intersection(a.cards)}
