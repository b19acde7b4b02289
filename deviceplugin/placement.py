"""Placement policy: which free IDs a node advertises, and which card a container should get.

Pure functions over a snapshot of the cards (``CardState``): no lock, no clock, no kubelet. The
allocator takes one snapshot under its lock and asks these functions; the tests call them with
hand-written tables.

**What a node advertises.** kubelet and kube-scheduler count ``fracgpu.io/core`` and
``fracgpu.io/memory`` separately and as sums over the node's cards, while a share of a card must
lie on one card. A node therefore reports as Healthy only free IDs that one card can host
together (:func:`advertised`):

- the free IDs of every *entirely free* card (whole-card pods need k of them);
- the free IDs of **one** partly used card, the *open* card (:func:`open_partial_card`);
- on each of those cards, free memory only while the card has free core and free core only
  while it has free memory (a card without one of the two can host no new container);
- while a container's first Allocate is pending, the other resource on its card(s), so that the
  second Allocate finds it (after whole cards' core, which may come without memory, only for a
  moment: see ``pairing``).

IDs kubelet has allocated stay Healthy (their pods keep running), so allocatable minus what the
scheduler counts as requested is exactly the advertised free capacity. A fraction that fits that
sum fits one card: either a whole free card (which hosts any share) or, with no whole free card,
the one partly used card, which alone carries every advertised free ID. k whole cards fit only
when k cards are entirely free, because the partly used card always lacks some core or memory.
kubelet picks only among Healthy IDs, so it cannot spread a share over cards either.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from core.units import CORE_PER_CARD
from deviceplugin.ids import Kind


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


@dataclass(frozen=True, slots=True)
class Pending:
    """A container's first Allocate, waiting for its second: its resource and card(s)."""

    kind: Kind
    cards: frozenset[int]


def advertised(
    cards: Collection[CardState],
    kind: Kind,
    *,
    open_card: int | None,
    pending: Pending | None = None,
) -> frozenset[int]:
    """The cards whose free ``kind`` IDs are listed Healthy (see the module docstring)."""
    listed = set()
    for card in cards:
        if not card.healthy:
            continue
        partner = pending is not None and pending.kind is not kind and card.index in pending.cards
        if partner:
            listed.add(card.index)  # the container's second Allocate comes next
            continue
        if card.free(other(kind)) == 0:
            continue  # stranded: no container can pair these with the other resource
        if card.entirely_free or card.index == open_card:
            listed.add(card.index)
    return frozenset(listed)


def numa_pick(whole: Collection[int], need: int, numa: Mapping[int, int | None]) -> list[int]:
    """``need`` of the ``whole`` cards on as few NUMA nodes as possible, best-fitting node first."""
    groups: dict[int, list[int]] = defaultdict(list)
    for card in sorted(whole):
        node = numa.get(card)
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


def whole_cards_needed(kind: Kind, size: int, whole: Collection[CardState]) -> int:
    """How many entirely free cards ``size`` IDs of ``kind`` stand for; 0 for a share of one.

    Core in hundreds is whole cards. Memory is whole cards when it is a multiple of the free
    cards' (equal) size: all of one card's memory is then taken as that card, not as a share of
    a bigger one.
    """
    if kind is Kind.CORE:
        return size // CORE_PER_CARD if size % CORE_PER_CARD == 0 else 0
    sizes = {card.blocks for card in whole}
    if len(sizes) != 1:
        return 0
    per = sizes.pop()
    return size // per if per and size % per == 0 else 0


def choose_cards(
    kind: Kind,
    size: int,
    free: Mapping[int, int],
    cards: Mapping[int, CardState],
    *,
    must: Collection[int] = (),
    allowed: Collection[int] | None = None,
    pending: Pending | None = None,
    other_size: int | None = None,
) -> list[int]:
    """The card(s) a container's ``size`` IDs of ``kind`` should come from, or [] for none.

    ``free`` counts the IDs kubelet offers per card (its available, Healthy, unallocated IDs).
    ``pending`` is the container's first half when this is its second resource: the same card(s)
    if they fit. ``other_size`` is the size the container's other resource is expected to have
    (learnt from earlier containers of the same shape), when known. ``allowed`` are the cards
    the plugin advertises for both resources now: kubelet's ``free`` may still hold IDs of a
    card hidden since its last message, and a first resource placed there would find its second
    hidden. IDs kubelet must include (an init container's, which the app container reuses) pin
    the card(s) whatever is advertised.
    """
    if pending is not None and pending.kind is not kind:
        hinted = sorted(pending.cards)
        if len(hinted) == 1 and free.get(hinted[0], 0) >= size:
            return hinted
        all_free = all(free.get(c, 0) == cards[c].total(kind) for c in hinted)
        if len(hinted) > 1 and all_free and size == sum(cards[c].total(kind) for c in hinted):
            return hinted
    candidates = [
        c for c in free if c in cards and (c in must if must else allowed is None or c in allowed)
    ]
    whole = [c for c in candidates if cards[c].entirely_free and free[c] == cards[c].total(kind)]
    need = whole_cards_needed(kind, size, [cards[c] for c in whole])
    if need:
        if len(whole) < need:
            return []
        return numa_pick(whole, need, {c: cards[c].numa_node for c in whole})
    fitting = [c for c in candidates if free[c] >= size]
    if other_size is not None:
        # a shape learnt from another workload may fit nowhere: then it says nothing
        fitting = [c for c in fitting if cards[c].free(other(kind)) >= other_size] or fitting
    if not fitting:
        return []
    # The other resource comes next and must fit on the same card, but its size may be unknown.
    # The webhook's defaults make requests close to proportional, so cards whose other resource
    # has at least the same share free come first.
    largest = max(cards[c].total(kind) for c in fitting)
    share = size / largest if largest else 1.0
    balanced = [
        c for c in fitting if cards[c].free(other(kind)) >= share * cards[c].total(other(kind))
    ]
    # Best fit: the card left with the least free after this container, so fractions pack onto
    # partly used cards and whole cards stay whole.
    return [min(balanced or fitting, key=lambda c: (free[c] - size, c))]


def pick_ids(
    kind: Kind,
    size: int,
    chosen: list[int],
    *,
    free: Mapping[int, Collection[int]],
    must: Mapping[int, Collection[int]],
    cards: Mapping[int, CardState],
) -> list[tuple[int, int]]:
    """(card, number) pairs for ``size`` IDs on the ``chosen`` cards, must-include first; [] if
    they do not add up."""
    picked: list[tuple[int, int]] = []
    for card in chosen:
        take = size if len(chosen) == 1 else cards[card].total(kind)
        numbers = sorted(set(must.get(card, ())))
        rest = sorted(set(free.get(card, ())) - set(numbers))
        numbers += rest[: max(take - len(numbers), 0)]
        picked += [(card, n) for n in numbers]
    return picked if len(picked) == size else []
