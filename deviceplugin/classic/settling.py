"""The settling moment: the number of Healthy IDs a change hid is kept listed for a while.

Not thread-safe: the allocator's lock guards it, and calls :meth:`Floors.note` after each change.
"""

from __future__ import annotations

from dataclasses import dataclass

from deviceplugin.classic.ids import Kind
from deviceplugin.classic.pairing import Clock

SETTLE_S = 2.0
"""How long the number of Healthy IDs of a resource is kept from falling after a change that is
neither kubelet's own allocation nor a card failing: in the Node's allocatable for this long,
in kubelet's lists for twice as long.

kube-scheduler decides by the Node's allocatable, which follows the lists a moment later (the
plugin writes it within milliseconds, kubelet at its status period), and kubelet admits each
pod the scheduler bound twice over: by its own count of the lists (device manager) and by the
Node's allocatable against the requests of the pods it runs, including ones it is still
stopping (its predicate check). A change can hide capacity both counted free: an ended
container's IDs released onto a card that is not offered, a share placed on an entirely free
card that hides the open card's rest. Had the lists or the Node's figure shrunk at once,
kubelet refused pods the scheduler had bound by the older figure (on the real cluster:
"requested 200, available 170"; "OutOffracgpu.io/memory ... used: 201, capacity: 178"). Kept,
such pods are admitted, placed, or wait for a card if none can host them
(``docs/device-plugin.md``). The lists keep the count longer than the Node, so that a pod the
scheduler bound at the end of the Node's moment still finds it in kubelet's count."""


@dataclass(slots=True)
class Floor:
    """Healthy IDs of a resource kept listed at least, for a moment (``SETTLE_S``)."""

    count: int
    node_until: float  # in the Node's allocatable until then (monotonic)
    lists_until: float  # in kubelet's lists until then
    node_ended: bool = False  # the Node's moment has been noted (the writer woken)


class Floors:
    """One floor per resource at most, with the count of Healthy IDs it is measured against."""

    def __init__(self, settle_s: float, clock: Clock) -> None:
        self.settle_s = settle_s
        self._clock = clock
        self.floors: dict[Kind, Floor] = {}
        self._listed: dict[Kind, int] = dict.fromkeys(Kind, 0)  # Healthy at the last change

    def note(
        self, kind: Kind, owned: int, offered_now: int, *, settle: bool, drop: bool, now: float
    ) -> None:
        """After a change: the ledger offers ``offered_now`` free IDs beside ``owned`` ones.

        A fall below what was listed starts a floor at the higher count (``settle`` false: a
        moment ended, which starts none; ``drop``: a card failed, and its capacity goes at once).
        """
        listed = owned + offered_now
        if drop:
            self.floors.pop(kind, None)
        elif settle and listed < self._listed[kind] and self.settle_s > 0:
            before = self.floors.get(kind)
            keep = max(self._listed[kind], before.count if before else 0)
            self.floors[kind] = Floor(keep, now + self.settle_s, now + 2 * self.settle_s)
        self._listed[kind] = owned + self.offered(kind, offered_now, owned)

    def offered(self, kind: Kind, offered_now: int, owned: int, *, node: bool = False) -> int:
        """What the lists (``node``: the Node's allocatable) offer: the ledger's offer, or more
        while a floor holds."""
        floor = self.floors.get(kind)
        if floor is not None and (floor.node_until if node else floor.lists_until) > self._clock():
            return max(offered_now, floor.count - owned)
        return offered_now

    def expire(self) -> bool:
        """Note the floors whose moment ended, on the Node or in the lists; whether one did
        (the streams and the Node's writer are then woken)."""
        now = self._clock()
        ended = False
        for kind, floor in list(self.floors.items()):
            if floor.lists_until <= now:
                del self.floors[kind]
                ended = True
            elif not floor.node_ended and floor.node_until <= now:
                floor.node_ended = True
                ended = True
        return ended

    def next_end(self, remaining: float) -> float:
        """``remaining`` seconds of a wait, cut short at the next end of a floor's moment."""
        for floor in self.floors.values():
            until = floor.lists_until if floor.node_ended else floor.node_until
            remaining = min(remaining, max(until - self._clock(), 0.001))
        return remaining
