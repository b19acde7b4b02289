"""The two Allocate calls of one container, paired.

kubelet allocates a container's resources one after the other, in map order (either resource
first), and never interleaves another container's calls between them. Between the two calls the
first is a *pending half*: the counterpart resource on its card(s) stays advertised, the second
resource's preference follows its card(s), and the second Allocate is checked against it. A half
that sees no partner within the window stands alone (a container with one resource, such as
whole cards admitted without memory).

Each completed pair also teaches the size the other resource had for a first resource of a given
size. Pods of one workload share their requests, so the next container whose first resource has
that size is placed where the second one fits too (the first call cannot otherwise know it).

Not thread-safe: the allocator's lock guards it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from deviceplugin.ids import Kind

LEARNT_SHAPES = 256  # distinct request shapes remembered (least recently used go first)


class Clock(Protocol):
    """Seconds as a float: ``time.monotonic`` for deadlines, ``time.time`` for records."""

    def __call__(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Half:
    """The first of a container's two Allocate calls, waiting for its partner."""

    kind: Kind
    cards: frozenset[int]
    key: str  # the allocation it belongs to
    size: int
    deadline: float  # monotonic


class Pairing:
    def __init__(self, window_s: float, clock: Clock) -> None:
        self.window_s = window_s
        self._clock = clock
        self._half: Half | None = None
        self._learnt: OrderedDict[tuple[Kind, int], int] = OrderedDict()

    @property
    def pending(self) -> Half | None:
        return self._half

    def expire(self) -> bool:
        """Drop a half whose window has passed; True when one was dropped."""
        if self._half is not None and self._clock() >= self._half.deadline:
            self._half = None
            return True
        return False

    def seconds_left(self) -> float | None:
        return None if self._half is None else self._half.deadline - self._clock()

    def begin(
        self,
        kind: Kind,
        cards: frozenset[int],
        key: str,
        size: int,
        *,
        window_s: float | None = None,
    ) -> None:
        window = self.window_s if window_s is None else min(window_s, self.window_s)
        self._half = Half(kind, cards, key, size, self._clock() + window)

    def partner_of(self, kind: Kind) -> Half | None:
        """The pending half this call of ``kind`` would complete (one of the other resource)."""
        half = self._half
        return half if half is not None and half.kind is not kind else None

    def end(self, second_size: int | None = None) -> Half | None:
        """Close the pending half (paired, failed or abandoned); learn the pair's shape."""
        half, self._half = self._half, None
        if half is not None and second_size is not None:
            self._learnt[(half.kind, half.size)] = second_size
            self._learnt.move_to_end((half.kind, half.size))
            while len(self._learnt) > LEARNT_SHAPES:
                self._learnt.popitem(last=False)
        return half

    def expected_other(self, kind: Kind, size: int) -> int | None:
        """The size the other resource had the last time a first ``kind`` call had ``size``."""
        return self._learnt.get((kind, size))
