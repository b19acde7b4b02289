"""What the node offers in the extender placement mode: every free ID of every healthy card.

In the mode ``node`` (``offer``) the plugin hides free IDs that no single card could host
together, keeps the lists from shrinking for a moment after a change (``settling``) and holds the
count between a container's two Allocate calls (``pairing``), because kubelet and the scheduler
count sums while a share must lie on one card. In the mode ``extender`` the scheduler extender
books every container on one card before it binds the pod, so what kubelet counts is already
placeable, and none of that is needed: the node lists as Healthy every ID of every healthy card
(its allocated IDs included) and nothing else. The count then follows card health alone, and so
does the Node's allocatable.

Why kubelet's count check then passes for every pod the extender bound (docs/device-plugin.md):
the IDs kubelet holds are its active pods', each booked on this node, so what it holds plus what
a new container asks is at most what is booked, which is at most the healthy cards' capacity,
which is what is listed Healthy.

Not thread-safe: the allocator's lock guards it. It has the interface of ``offer.Offer`` that the
allocator uses; its floors never start (a moment of zero seconds).
"""

from __future__ import annotations

from deviceplugin.classic.allocation import Allocation
from deviceplugin.classic.ids import Kind
from deviceplugin.classic.ledger import Ledger
from deviceplugin.classic.pairing import Clock
from deviceplugin.classic.settling import Floors
from deviceplugin.classic.shown import ShownIds


class FullOffer:
    def __init__(self, ledger: Ledger, shown: ShownIds, clock: Clock) -> None:
        self._ledger = ledger
        self._shown = shown
        self.floors = Floors(0.0, clock)  # never set: nothing is kept after a change

    def update(self, *, settle: bool, drop_floors: bool) -> None:
        """After a change: nothing to choose or keep (the count is computed when listed)."""

    def now(self, kind: Kind) -> int:
        """Free IDs listed Healthy: the healthy cards' capacity, less the allocated IDs that are
        listed Healthy (those of containers on a card that failed are Unhealthy)."""
        ledger = self._ledger
        healthy = sum(card.total(kind) for card in ledger.snapshot().values() if card.healthy)
        sick = ledger.sick_keys()
        owner = ledger.owner
        on_sick_cards = (
            sum(
                1
                for key in sick
                for device in _ids(ledger.allocations[key], kind)
                if owner.get(device) == key
            )
            if sick
            else 0
        )
        return max(healthy - (self._shown.owned_count(kind) - on_sick_cards), 0)

    def listed(self, kind: Kind, *, node: bool = False) -> int:
        """What the lists and the Node's allocatable offer: the same, at once."""
        return self.now(kind)


def _ids(allocation: Allocation, kind: Kind) -> tuple[str, ...]:
    return allocation.core if kind is Kind.CORE else allocation.memory


__all__ = ["FullOffer"]
