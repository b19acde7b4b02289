"""The ListAndWatch lists, kept per resource and per group of IDs.

IDs are counts (see ``placement``): what kubelet must see is every allocated ID, Healthy while
its container's card works, and as many free IDs Healthy as the node offers. Which free IDs
those are does not matter; the allocator keeps the same ones from one list to the next where
it can, so that most allocations (which take IDs that were shown) change no list at all.

IDs are grouped by the ``g<index>`` part of their name, one group per card of the node (the
same names as before IDs became counts, so kubelet's records of running pods stay valid across
an upgrade). A group's list is a function of its *state* (which of its numbers are Healthy);
a list is rebuilt only when its group's state changes, and a group's tuple stays the same
object while its state holds, so callers may cache what they derive from it (an encoding) by
identity.

Not thread-safe: the allocator builds lists under its lock, from one snapshot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from deviceplugin.classic.ids import DeviceId, Kind


@dataclass(frozen=True, slots=True)
class ListedDevice:
    id: str
    healthy: bool  # no topology: an ID names no card, so it has no NUMA node either


@dataclass(frozen=True, slots=True)
class GroupState:
    healthy: frozenset[int]  # the numbers listed Healthy: allocated (card working) or shown free


class ListingCache:
    def __init__(self, totals: Mapping[Kind, Mapping[int, int]]):
        self._totals = totals
        self._lists: dict[tuple[Kind, int], tuple[GroupState, tuple[ListedDevice, ...]]] = {}

    def lists(
        self, kind: Kind, states: Sequence[tuple[int, GroupState]]
    ) -> list[tuple[ListedDevice, ...]]:
        """Each group's devices for these (group, state) pairs, in the order given."""
        lists = []
        for group, state in states:
            cached = self._lists.get((kind, group))
            if cached is None or cached[0] != state:
                cached = self._lists[(kind, group)] = (state, self._build(kind, group, state))
            lists.append(cached[1])
        return lists

    def _build(self, kind: Kind, group: int, state: GroupState) -> tuple[ListedDevice, ...]:
        return tuple(
            ListedDevice(str(DeviceId(group, kind, n)), n in state.healthy)
            for n in range(self._totals[kind][group])
        )
