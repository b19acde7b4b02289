"""GPU models as admission sizes requests against them, and the candidates a pod may land on.

A ``GpuModel`` is a kind of card (a product name and its memory), known from node labels or
configuration (``webhook.inventory``), or from the cluster's ResourceSlices in DRA mode
(``webhook.claims``). It is not a physical card: the node agents own those
(``deviceplugin.shared.inventory``).
"""

from __future__ import annotations

from dataclasses import dataclass

from core.labels import PRODUCT_LABEL
from core.units import card_blocks


@dataclass(frozen=True, slots=True)
class GpuModel:
    """A GPU model as the inventory knows it."""

    product: str
    memory_mib: int


@dataclass(frozen=True, slots=True)
class CardChoice:
    """The GPU models a pod's request may be sized against, chosen by the inventory from
    placement.

    ``cards`` are the candidate models, smallest first: the smallest sizes fractions and
    percentages (the share then fits wherever the pod lands), the largest bounds explicit
    memory, and a memory-only request is sized for the smallest that holds it. With no
    candidate, ``unknown`` says what the operator must configure. ``pin`` is the label a pod
    pins a model with, for the warning shown when several models were possible.
    """

    cards: tuple[GpuModel, ...] = ()
    pin: str = PRODUCT_LABEL
    unknown: str = "no GPU models are known to fracgpu"

    @property
    def card(self) -> GpuModel | None:
        return self.cards[0] if self.cards else None

    @property
    def largest(self) -> GpuModel | None:
        return self.cards[-1] if self.cards else None

    def fitting(self, blocks: int) -> GpuModel | None:
        """The smallest candidate with at least ``blocks`` of memory (else the smallest)."""
        for card in self.cards:
            if card_blocks(card.memory_mib) >= blocks:
                return card
        return self.card

    def warning(self, used: GpuModel) -> str | None:
        """Shown when the pod may land on a model with another size than the one used."""
        if all(c.memory_mib == used.memory_mib for c in self.cards):
            return None
        which = "the smallest" if used == self.card else "the smallest that holds the request"
        return (
            f"sized for {used.product} ({used.memory_mib} MiB), {which} of {len(self.cards)} "
            f"GPU models it may land on; pin a model with nodeSelector {self.pin} to size for "
            f"another"
        )
