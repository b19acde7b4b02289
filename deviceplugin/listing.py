"""The ListAndWatch lists, kept per resource and card.

A card's list is a function of its health and, when its free IDs are hidden by the placement
rules, of which of its IDs are allocated (those stay Healthy). That pair is the card's *state*;
a list is rebuilt only when its card's state changes, so one change to a node with thousands of
IDs rebuilds one card's list. A card's tuple stays the same object while its state holds, and
callers may cache what they derive from it (an encoding) by identity.

Not thread-safe: the allocator builds lists under its lock, from one snapshot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from deviceplugin.ids import DeviceId, Kind


@dataclass(frozen=True, slots=True)
class ListedDevice:
    id: str
    healthy: bool
    numa_node: int | None


@dataclass(frozen=True, slots=True)
class CardListState:
    healthy: bool
    # the allocated numbers when the card's free IDs are hidden; None when they are listed
    shown_only: frozenset[int] | None


class ListingCache:
    def __init__(self, totals: Mapping[Kind, Mapping[int, int]], numa: Mapping[int, int | None]):
        self._totals = totals
        self._numa = numa
        self._lists: dict[tuple[Kind, int], tuple[CardListState, tuple[ListedDevice, ...]]] = {}

    def lists(
        self, kind: Kind, states: Sequence[tuple[int, CardListState]]
    ) -> list[tuple[ListedDevice, ...]]:
        """Each card's devices for these (card, state) pairs, in the order given."""
        lists = []
        for card, state in states:
            cached = self._lists.get((kind, card))
            if cached is None or cached[0] != state:
                cached = self._lists[(kind, card)] = (state, self._build(kind, card, state))
            lists.append(cached[1])
        return lists

    def _build(self, kind: Kind, card: int, state: CardListState) -> tuple[ListedDevice, ...]:
        shown = state.shown_only
        numa = self._numa.get(card)
        return tuple(
            ListedDevice(
                str(DeviceId(card, kind, n)),
                state.healthy and (shown is None or n in shown),
                numa,
            )
            for n in range(self._totals[kind][card])
        )
