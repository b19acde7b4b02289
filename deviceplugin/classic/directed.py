"""Extender placement: a container goes where its pod's placement record says, or waits.

In the placement mode ``extender`` the card is chosen at scheduling time, by fracgpu's scheduler
extender, which books it on the node's ledger and records it on the pod through the Binding
(``core.placement``). The plugin learns the container's pod only once kubelet lists the container
in PodResources (early verification or PreStartContainer, never at Allocate, where it would have
to guess), reads the record there and *directs* the container (``Allocation.directed``) to the
card(s) it names. This chooser then places it there if this plugin's own ledger has room, and
otherwise leaves it waiting: the node never overcommits a card, even when the extender's
bookings and what runs here disagree (a force-deleted pod still stopping).

Which containers it places, and where:

- directed to cards: exactly those, if they hold it now (a share: the one card has its core and
  memory free; whole cards: every named card entirely free and healthy), else none yet;
- directed to ``()``: its pod has no record (created before the switch, or placed by another
  scheduler): the node's own best fit, as in the mode ``node``;
- not directed yet: none, it waits for its record (read at early verification, at
  PreStartContainer, or, for a container adopted from a listing without a limits file that
  names its card, right after the reconciliation that adopted it: ``recovery``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from core.units import CORE_PER_CARD
from deviceplugin.classic.allocation import Allocation
from deviceplugin.classic.allocator import Allocator
from deviceplugin.classic.fulloffer import FullOffer
from deviceplugin.classic.ids import Kind
from deviceplugin.classic.ledger import Ledger, best_fit
from deviceplugin.classic.offer import Offer
from deviceplugin.classic.pairing import Clock
from deviceplugin.classic.placement import CardState


class DirectedAllocator(Allocator):
    """The allocator of the extender placement mode: the ledger places a container where
    :func:`choose_directed` says, and the lists offer every ID of every healthy card
    (``fulloffer``). Allocate records and pairs as in the mode ``node``; it places nothing."""

    def _units(self, settle_s: float, clock: Clock) -> tuple[Ledger, Offer | FullOffer]:
        ledger = Ledger(self.cards, self.blocks, self.shown, choose_directed)
        return ledger, FullOffer(ledger, self.shown, clock)

    def direct(self, allocation: Allocation, cards: tuple[int, ...]) -> bool:
        """Place ``allocation`` on ``cards`` (its pod's record; ``()``: no record, best fit) as
        soon as they have room; whether it is placed now."""
        with self._cond:
            if self.ledger.allocations.get(allocation.key) is allocation:  # else: dropped
                allocation.directed = cards
                if self.ledger.place(allocation):
                    self._changed()
            return bool(allocation.cards)


def choose_directed(cards: Mapping[int, CardState], allocation: Allocation) -> list[int]:
    """The card(s) for an unplaced container in the extender mode; [] while it waits."""
    target = allocation.directed
    if target is None:
        return []
    if not target:
        return best_fit(cards, allocation)
    return fit_exactly(cards, target, len(allocation.core), len(allocation.memory))


def fit_exactly(
    cards: Mapping[int, CardState], target: Collection[int], core: int, memory: int
) -> list[int]:
    """``target`` if a container of ``core`` hundredths and ``memory`` blocks fits there now,
    else []: whole cards (core in hundreds) need every one of them entirely free, a share its
    one card with both amounts free."""
    states = [cards.get(i) for i in target]
    if not states or any(s is None or not s.healthy for s in states):
        return []
    if core > 0 and core % CORE_PER_CARD == 0:
        fits = len(states) == core // CORE_PER_CARD and all(
            s is not None and s.entirely_free for s in states
        )
    else:
        (state,) = states if len(states) == 1 else (None,)
        fits = (
            state is not None
            and 0 < core < CORE_PER_CARD
            and state.free(Kind.CORE) >= core
            and state.free(Kind.MEMORY) >= memory
        )
    return sorted(target) if fits else []


__all__ = ["DirectedAllocator", "choose_directed", "fit_exactly"]
