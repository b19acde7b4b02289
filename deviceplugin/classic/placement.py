"""Placement policy: which card a container gets, and how much free capacity a node offers.

Pure functions over a snapshot of the cards (``CardState``): no lock, no clock, no kubelet. The
allocator takes one snapshot under its lock and asks these functions; the tests call them with
hand-written tables.

**Device IDs are counts.** kubelet picks a container's IDs itself, per resource, from what it
believes free, and may pick any of them; so an ID names no card. The plugin places each
container from its own per-card ledger once it knows both of the container's amounts
(:func:`place`), and kubelet's choice of IDs never matters.

**What a node offers.** kubelet and kube-scheduler count ``fracgpu.io/core`` and
``fracgpu.io/memory`` separately and as sums, while a share must lie on one card. A node
therefore offers (lists as Healthy, beside every allocated ID) only as many free IDs as the cards
of :func:`advertised` have free:

- every *entirely free* card (whole-card pods need k of them);
- **one** partly used card, the *open* card (:func:`open_partial_card`);
- of those cards, free memory only while the card has free core and free core only while it has
  free memory (a card without one of the two can host no new container).

A share that fits both offered sums fits one card: an entirely free card hosts any share, and
with none, everything offered lies on the open card. k whole cards fit the sums only when k
cards are entirely free, because the open card always lacks some core or memory. See
``docs/device-plugin.md`` for why no choice of IDs by kubelet can then fail a pod.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from core.placement import numa_pick
from core.units import CORE_PER_CARD
from deviceplugin.classic.ids import Kind


@dataclass(frozen=True, slots=True)
class CardState:
    """One card as placement sees it: its size, what is allocated, whether it works."""

    index: int
    blocks: int  # memory IDs the card advertises
    core_used: int = 0
    memory_used: int = 0
    healthy: bool = True
    numa_node: int | None = None

    def total(self, kind: Kind) -> int:
        return CORE_PER_CARD if kind is Kind.CORE else self.blocks

    def used(self, kind: Kind) -> int:
        return self.core_used if kind is Kind.CORE else self.memory_used

    def free(self, kind: Kind) -> int:
        return self.total(kind) - self.used(kind)

    @property
    def entirely_free(self) -> bool:
        return self.core_used == 0 and self.memory_used == 0

    @property
    def hosts_new_share(self) -> bool:
        """A new container needs some core and some memory of one card."""
        return self.free(Kind.CORE) > 0 and self.free(Kind.MEMORY) > 0


def other(kind: Kind) -> Kind:
    return Kind.MEMORY if kind is Kind.CORE else Kind.CORE


def open_partial_card(
    cards: Collection[CardState], current: int | None = None, *, keep: bool = False
) -> int | None:
    """The one partly used card whose free IDs are advertised, or None.

    The partly used card with the most free core, then the most free memory; among equals the
    ``current`` open card stays open, else the lower index wins. The most free core keeps the
    most capacity on offer (a card with 0.1 left must not hide one with 0.7). Staying among
    equals avoids needless flips: kubelet's view of the lists trails the plugin by a message,
    and a card listed and hidden again could still receive a container's first resource whose
    second would then find it hidden.

    With ``keep`` (a container's first Allocate is pending) the current open card stays while it
    can host a share: the pending half changes the counts, and letting that flip the open card
    would list a second partly used card beside the pending one until the pair completes.
    """
    partial = [c for c in cards if c.healthy and not c.entirely_free and c.hosts_new_share]
    if keep and any(c.index == current for c in partial):
        return current
    if not partial:
        return None
    best = max(
        partial,
        key=lambda c: (c.free(Kind.CORE), c.free(Kind.MEMORY), c.index == current, -c.index),
    )
    return best.index


def advertised(
    cards: Collection[CardState],
    kind: Kind,
    *,
    open_card: int | None,
) -> frozenset[int]:
    """The cards whose free ``kind`` capacity is offered (see the module docstring)."""
    listed = set()
    for card in cards:
        if not card.healthy:
            continue
        if card.free(other(kind)) == 0:
            continue  # stranded: no container can pair these with the other resource
        if card.entirely_free or card.index == open_card:
            listed.add(card.index)
    return frozenset(listed)


def offered(cards: Collection[CardState], kind: Kind, *, open_card: int | None) -> int:
    """How many free ``kind`` IDs the node lists as Healthy: the free capacity of the cards
    :func:`advertised` names."""
    shown = advertised(cards, kind, open_card=open_card)
    return sum(card.free(kind) for card in cards if card.index in shown)


def place(cards: Mapping[int, CardState], core: int, memory: int) -> list[int]:
    """The card(s) for a container of ``core`` hundredths and ``memory`` blocks; [] if none.

    ``core`` in hundreds is that many whole cards: entirely free, on as few NUMA nodes as
    possible (their memory is all theirs, whatever ``memory`` says). A share (1-99) goes to the
    card with the **best fit** among the healthy cards where both amounts fit: the one left
    with the least free core, then memory, after it. Shares therefore pack onto cards already
    in use and whole cards stay whole; any fitting card is safe, advertised or not, because the
    ledger, not the IDs, says what each card holds.
    """
    if core <= 0:
        return []
    if core % CORE_PER_CARD == 0:
        need = core // CORE_PER_CARD
        whole = [c.index for c in cards.values() if c.healthy and c.entirely_free]
        if len(whole) < need:
            return []
        return numa_pick(whole, need, {i: c.numa_node for i, c in cards.items()})
    if core > CORE_PER_CARD:
        return []
    fitting = [
        c
        for c in cards.values()
        if c.healthy and c.free(Kind.CORE) >= core and c.free(Kind.MEMORY) >= memory
    ]
    if not fitting:
        return []
    best = min(
        fitting,
        key=lambda c: (
            c.entirely_free,
            c.free(Kind.CORE) - core,
            c.free(Kind.MEMORY) - memory,
            c.index,
        ),
    )
    return [best.index]
