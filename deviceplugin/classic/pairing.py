"""The two Allocate calls of one container, paired.

kubelet allocates a container's resources one after the other, in map order (either resource
first), and never interleaves another container's calls between them. Between the two calls the
first is a *pending half*: the plugin knows one of the container's two amounts, so it cannot
place the container yet. The second call completes the pair, and the container is placed with
both amounts known. A half that sees no partner within the window stands alone (a container
with one resource, such as whole cards, which come without memory).

Not thread-safe: the allocator's lock guards it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from deviceplugin.classic.ids import Kind


class Clock(Protocol):
    """Seconds as a float: ``time.monotonic`` for deadlines, ``time.time`` for records."""

    def __call__(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Half:
    """The first of a container's two Allocate calls, waiting for its partner."""

    kind: Kind
    key: str  # the allocation it belongs to
    size: int
    deadline: float  # monotonic
    # how many IDs of the other resource were listed Healthy when the first call came: kubelet
    # checks the second call against its count of them, so the list must not shrink below it
    hold: int = 0


class Pairing:
    def __init__(self, window_s: float, clock: Clock) -> None:
        self.window_s = window_s
        self._clock = clock
        self._half: Half | None = None

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
        self, kind: Kind, key: str, size: int, *, hold: int = 0, window_s: float | None = None
    ) -> None:
        window = self.window_s if window_s is None else min(window_s, self.window_s)
        self._half = Half(kind, key, size, self._clock() + window, hold)

    def partner_of(self, kind: Kind) -> Half | None:
        """The pending half this call of ``kind`` would complete (one of the other resource)."""
        half = self._half
        return half if half is not None and half.kind is not kind else None

    def end(self) -> Half | None:
        """Close the pending half (paired or abandoned)."""
        half, self._half = self._half, None
        return half
