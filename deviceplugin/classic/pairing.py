"""The two Allocate calls of one container, paired.

kubelet allocates a container's resources one after the other, in map order (either resource
first), and never interleaves another container's calls between them. Between the two calls the
first is a *pending half*: the plugin knows one of the container's two amounts, so it cannot
place the container yet. The second call completes the pair, and the container is placed with
both amounts known. A half that sees no partner within the window stands alone (a container
with one resource, such as whole cards, which come without memory).

While a half is pending, what the node offers is adjusted (:func:`pending_offer`), so that the
two calls of one container see consistent lists.

Not thread-safe: the allocator's lock guards it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

from deviceplugin.classic.allocation import Allocation
from deviceplugin.classic.ids import Kind

WHOLE_CORE_PAIR_S = 0.5
"""How long whole cards' core waits for a memory call. Whole cards come without memory now;
kubelet makes a container's second call within milliseconds, so a moment is enough for pods
that still carry memory."""


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

    @property
    def pending_key(self) -> str | None:
        """The allocation of the pending half: not complete, so not waiting for a card."""
        return None if self._half is None else self._half.key

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

    def partner(
        self,
        kind: Kind,
        size: int,
        allocations: Mapping[str, Allocation],
        blocks: Mapping[int, int],
    ) -> Allocation | None:
        """The container whose first call this one of ``kind`` and ``size`` IDs completes, if
        any (``allocations``: by key; ``blocks``: memory IDs per card). A pending half that this
        call cannot complete is ended: the call is the next container's first."""
        half = self.partner_of(kind)
        partner = None if half is None else allocations.get(half.key)
        if (
            partner is not None
            and partner.whole_cards
            and kind is Kind.MEMORY
            and size != whole_cards_memory(partner.cards, partner.whole_cards, blocks)
        ):
            self.end()
            return None
        return partner

    def end(self) -> Half | None:
        """Close the pending half (paired or abandoned)."""
        half, self._half = self._half, None
        return half


def whole_cards_memory(cards: Collection[int], whole: int, blocks: Mapping[int, int]) -> int:
    """How many memory IDs a memory call after ``whole`` cards (placed on ``cards``, or not yet)
    must hold to be their partner: all of their cards' memory.

    Whole cards come without memory now: a memory call of any other size after them is the next
    container's first call, not their second.
    """
    return sum(blocks[c] for c in cards) or whole * max(blocks.values())


def pending_offer(offered: int, kind: Kind, half: Half, *, unplaced: bool, owned: int) -> int:
    """What the node offers of ``kind`` while ``half`` is pending (``unplaced``: its container
    has no card yet; ``owned``: the allocated IDs of ``kind``)."""
    if half.kind is kind and unplaced:
        # The first call's IDs came out of what was offered; the ledger cannot hold them
        # until the container is placed, so they are taken off here.
        offered = max(offered - half.size, 0)
    if half.kind is not kind:
        # Between a container's two calls, kubelet counts the second against the IDs it
        # saw Healthy at the first; what that call changed (ended containers released,
        # whole cards placed, another card opened) must not shrink that list meanwhile.
        offered = max(offered, half.hold - owned)
    return offered
