"""How many free IDs of each resource the node offers: in kubelet's lists and on the Node.

Three things decide it, each owned elsewhere and combined here: what the ledger's cards have
free on the cards ``placement`` advertises (the entirely free ones and the one *open* card,
chosen here after each change); what the pending first half of a container's two Allocate calls
does to the count (``pairing.pending_offer``); and the floor a change leaves for a moment
(``settling``). While a container waits for a card, nothing is offered.

Not thread-safe: the allocator's lock guards it, and calls :meth:`Offer.update` after each
change.
"""

from __future__ import annotations

from deviceplugin.classic import placement
from deviceplugin.classic.ids import Kind
from deviceplugin.classic.ledger import Ledger
from deviceplugin.classic.pairing import Clock, Pairing, pending_offer
from deviceplugin.classic.settling import Floors
from deviceplugin.classic.shown import ShownIds


class Offer:
    def __init__(
        self, ledger: Ledger, shown: ShownIds, pairing: Pairing, settle_s: float, clock: Clock
    ) -> None:
        self._ledger = ledger
        self._shown = shown
        self._pairing = pairing
        self._clock = clock
        self.floors = Floors(settle_s, clock)  # see settling.SETTLE_S
        self.open_card: int | None = None  # the one partly used card offered (placement)

    def update(self, *, settle: bool, drop_floors: bool) -> None:
        """After a change: choose the open card, and keep the lists from shrinking for a
        moment (``settle`` false: a moment ended; ``drop_floors``: a card failed, its capacity
        is withdrawn at once)."""
        cards = list(self._ledger.snapshot().values())
        self.open_card = placement.open_partial_card(
            cards, self.open_card, keep=self._pairing.pending is not None
        )
        now = self._clock()
        waiting = bool(self._ledger.waiting(self._pairing.pending_key))
        for kind in Kind:
            owned = self._shown.owned_count(kind)
            offered_now = self.now(kind, cards=cards, waiting=waiting)
            self.floors.note(kind, owned, offered_now, settle=settle, drop=drop_floors, now=now)

    def now(
        self,
        kind: Kind,
        *,
        cards: list[placement.CardState] | None = None,
        waiting: bool | None = None,
    ) -> int:
        """What the ledger offers now, before the settling floor (``cards``, ``waiting``: from
        the caller's snapshot, when it has one)."""
        if self._ledger.waiting(self._pairing.pending_key) if waiting is None else waiting:
            # Admitted containers wait for a card: what frees up is theirs first, and nothing
            # new is invited to this node until they are placed.
            return 0
        if cards is None:
            cards = list(self._ledger.snapshot().values())
        offered = placement.offered(cards, kind, open_card=self.open_card)
        half = self._pairing.pending
        if half is None:
            return offered
        partner = self._ledger.allocations.get(half.key)
        unplaced = partner is not None and not partner.cards
        owned = self._shown.owned_count(kind)
        return pending_offer(offered, kind, half, unplaced=unplaced, owned=owned)

    def listed(self, kind: Kind, *, node: bool = False) -> int:
        """What the lists (``node``: the Node's allocatable) offer: the ledger's offer, or more
        while a floor holds."""
        return self.floors.offered(kind, self.now(kind), self._shown.owned_count(kind), node=node)
