"""Which IDs ListAndWatch lists Healthy, per resource and per ID group (one group per card).

Healthy are every allocated ID (while its container's card works) and as many free IDs as the
node offers (``placement``). Which free IDs those are does not matter (IDs are counts), so the
ones shown are kept from one list to the next as far as the offer allows: kubelet allocates only
Healthy IDs, so an allocation that takes what was offered turns shown free IDs into allocated
ones, both Healthy, and the list does not change at all. Only a change of the offer adds the
lowest free IDs or drops the highest shown ones.

The allocated numbers are kept here per group, in step with the ledger's owners, because every
list reads them; a group whose numbers changed is *dirty* and its state is computed again at
the next list, the others are reused as they are (``listing.ListingCache`` keeps their tuples).

Not thread-safe: the allocator's lock guards it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from core.units import CORE_PER_CARD
from deviceplugin.classic.ids import DeviceId, Kind
from deviceplugin.classic.listing import GroupState, ListedDevice, ListingCache

Group = tuple[Kind, int]  # (resource, card index of the IDs' g<index> part)


class ShownIds:
    def __init__(self, blocks: Mapping[int, int]) -> None:
        self._groups = sorted(blocks)
        self._blocks = blocks
        # (kind, ID group) -> allocated numbers (read on every list)
        self.owned: dict[Group, set[int]] = {(kind, i): set() for kind in Kind for i in blocks}
        # (kind, ID group) -> the free numbers listed Healthy
        self._shown: dict[Group, set[int]] = {(kind, i): set() for kind in Kind for i in blocks}
        self._shown_count: dict[Kind, int] = dict.fromkeys(Kind, 0)
        # (kind, group) -> its last state, and the groups whose IDs changed since
        self._states: dict[Group, GroupState] = {}
        self._dirty: set[Group] = {(kind, i) for kind in Kind for i in blocks}
        # per resource: whether the last list left out a failed card's allocated IDs (the next
        # one then computes every group afresh, so that they come back when the card does)
        self._sick_listed: dict[Kind, bool] = dict.fromkeys(Kind, False)
        totals = {Kind.CORE: dict.fromkeys(blocks, CORE_PER_CARD), Kind.MEMORY: dict(blocks)}
        self._lists = ListingCache(totals)

    def take(self, parsed: DeviceId) -> None:
        """An ID became allocated (a shown free one stays Healthy, as an allocated one)."""
        group = (parsed.kind, parsed.card)
        owned = self.owned.get(group)
        if owned is not None:
            owned.add(parsed.number)
            shown = self._shown[group]
            if parsed.number in shown:
                shown.discard(parsed.number)
                self._shown_count[parsed.kind] -= 1
            self._dirty.add(group)

    def release(self, parsed: DeviceId) -> None:
        """An allocated ID became free."""
        group = (parsed.kind, parsed.card)
        owned = self.owned.get(group)
        if owned is not None:
            owned.discard(parsed.number)
            self._dirty.add(group)

    def owned_count(self, kind: Kind) -> int:
        return sum(len(self.owned[(kind, group)]) for group in self._groups)

    def shown_count(self, kind: Kind) -> int:
        return self._shown_count[kind]

    def listing(
        self,
        kind: Kind,
        target: int,
        *,
        owner: Mapping[str, str],
        sick_keys: Collection[str],
    ) -> tuple[object, list[tuple[ListedDevice, ...]]]:
        """A signature of the list and the list itself per group, showing ``target`` free IDs.

        Allocated IDs whose owner (``owner``: ID -> allocation key) is in ``sick_keys`` (its
        card failed) are listed Unhealthy. Equal signatures mean equal lists; a group's tuple
        is the same object for as long as its Healthy IDs hold (``listing``).
        """
        if self._shown_count[kind] > target:
            self._show_fewer(kind, self._shown_count[kind] - target)
        elif self._shown_count[kind] < target:
            self._show_more(kind, target - self._shown_count[kind])
        states = []
        recompute = bool(sick_keys) or self._sick_listed[kind]
        self._sick_listed[kind] = bool(sick_keys)
        for group in self._groups:
            where = (kind, group)
            state = self._states.get(where)
            if state is None or where in self._dirty or recompute:
                owned = self.owned[where]
                if sick_keys:
                    owned = {
                        n
                        for n in owned
                        if owner.get(str(DeviceId(group, kind, n))) not in sick_keys
                    }
                state = GroupState(frozenset(owned | self._shown[where]))
                if state != self._states.get(where):
                    self._states[where] = state
                else:
                    state = self._states[where]
                self._dirty.discard(where)
            states.append((group, state))
        return tuple(states), self._lists.lists(kind, states)

    def _show_fewer(self, kind: Kind, count: int) -> None:
        """Stop showing ``count`` free IDs of ``kind``, the highest first."""
        for group in reversed(self._groups):
            shown = self._shown[(kind, group)]
            while shown and count:
                shown.discard(max(shown))
                count -= 1
                self._shown_count[kind] -= 1
                self._dirty.add((kind, group))
            if not count:
                return

    def _show_more(self, kind: Kind, count: int) -> None:
        """Show ``count`` more free IDs of ``kind``, the lowest first."""
        for group in self._groups:
            owned, shown = self.owned[(kind, group)], self._shown[(kind, group)]
            total = CORE_PER_CARD if kind is Kind.CORE else self._blocks[group]
            if len(owned) + len(shown) >= total:
                continue
            for number in range(total):
                if count == 0:
                    return
                if number not in owned and number not in shown:
                    shown.add(number)
                    count -= 1
                    self._shown_count[kind] += 1
                    self._dirty.add((kind, group))
