"""How much compute each share on one card may use this period: its guarantee, or more while the
node lends it compute that no active share uses.

Why a policy at all: the hook holds each share to a ceiling it reads from the ``usage`` file the
node agent writes (core/contract.py). Holding every share to its guarantee wastes the card
whenever an owner is idle; letting every share run free lets a busy one take a returning owner's
guarantee. Lending only what no *active* share is guaranteed, and taking it back the period its
owner is active again, keeps every guarantee while the card stays busy.

Pure and deterministic: the node agent's loop measures (used percent per share from NVML's
per-process samples), calls :func:`ceilings` once per period and writes the files; this module
neither reads nor writes anything, so its rules are tested on their own.

Rules, per card:

- every share's ceiling is at least its guarantee;
- a share is *active* when it used at least ``ACTIVE_PERCENT`` over the last window; the
  compute that is lendable is what the active shares are not guaranteed (idle owners'
  guarantees and the unassigned rest of the card);
- it goes to the shares that want more (:func:`wants_more`: held back at their guarantee, or
  still using a loan) and may burst: high priority first, then low; within a priority in
  proportion to guarantees, each capped at its own limit (the most it asked to burst to, at
  most 100), what a cap leaves going to the others;
- a share that may not burst, or does not want more, keeps ceiling = guarantee;
- an owner that becomes active again takes its guarantee out of the lendable compute at once,
  so the borrowers' ceilings drop at the same period.

Integer percents: what is lent never exceeds what is lendable, so the ceilings of the active
shares never promise more than the card.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from core.policy import Priority

ACTIVE_PERCENT = 1.0  # used at least this over the window: the share's owner is running work
WANT_MARGIN = 5.0  # used within this of its ceiling: the share is held back and wants more


@dataclass(frozen=True, slots=True)
class ShareState:
    """One share on the card, as the node agent saw it over the last window."""

    key: Hashable
    guarantee: int  # compute_percent of its limits file, 1-100
    priority: Priority
    may_burst: bool
    used: float  # its own SM use over the last window, all of its processes, 0-100
    wants_more: bool  # see :func:`wants_more`
    cap: int = 100  # the most it may burst to (its limit), guarantee to 100

    def __post_init__(self) -> None:
        if not 1 <= self.guarantee <= 100:
            raise ValueError(f"guarantee must be 1-100, got {self.guarantee}")
        if not 0 <= self.used <= 100:
            raise ValueError(f"used must be 0-100, got {self.used}")
        if not self.guarantee <= self.cap <= 100:
            raise ValueError(f"cap must be the guarantee to 100, got {self.cap}")


def wants_more(used: float, ceiling: int, guarantee: int, margin: float = WANT_MARGIN) -> bool:
    """Whether a share wants more than its guarantee, from its last window.

    Without a loan (ceiling = guarantee): it ran at its ceiling, less margin, so the hook held
    it back. On a loan: it still uses the loan, more than its guarantee plus margin. Why the
    second rule: asking a borrower to stay within margin of a lent ceiling takes the loan away
    whenever a window falls short of it (a borrower whose demand lies between guarantee and
    ceiling, or a window dented by the host), the hook then drops it to its guarantee at once,
    and the next window lends it again: the ceiling would alternate at the agent's period.
    """
    if ceiling > guarantee:
        return used > guarantee + margin
    return used >= ceiling - margin


def ceilings(shares: Sequence[ShareState]) -> dict[Hashable, int]:
    """The ceiling of each share (by key) for the next period; see the module's rules."""
    keys = [s.key for s in shares]
    if len(set(keys)) != len(keys):
        raise ValueError("share keys must be distinct")
    result: dict[Hashable, int] = {s.key: s.guarantee for s in shares}
    active_guaranteed = sum(s.guarantee for s in shares if s.used >= ACTIVE_PERCENT)
    lendable = max(0, 100 - active_guaranteed)
    for priority in (Priority.HIGH, Priority.LOW):
        borrowers = [s for s in shares if s.priority is priority and s.may_burst and s.wants_more]
        given = _split(
            lendable, {s.key: s.guarantee for s in borrowers}, {s.key: s.cap for s in borrowers}
        )
        for key, extra in given.items():
            result[key] += extra
            lendable -= extra
    return result


def _split(
    amount: int, weights: Mapping[Hashable, int], caps: Mapping[Hashable, int]
) -> dict[Hashable, int]:
    """Split amount in proportion to weights (guarantees), each capped at cap - weight; what a
    cap leaves goes round again to the uncapped, until nothing more can be placed."""
    given: dict[Hashable, int] = dict.fromkeys(weights, 0)
    open_keys = [k for k in weights if weights[k] < caps[k]]
    while amount > 0 and open_keys:
        total = sum(weights[k] for k in open_keys)
        placed = 0
        for k in open_keys:
            room = caps[k] - weights[k] - given[k]
            share = min(room, amount * weights[k] // total)
            given[k] += share
            placed += share
        if placed == 0:  # rounding left less than one point per share: give it out one by one
            for k in sorted(open_keys, key=lambda key: -weights[key]):
                if placed < amount and given[k] < caps[k] - weights[k]:
                    given[k] += 1
                    placed += 1
        amount -= placed
        open_keys = [k for k in open_keys if given[k] < caps[k] - weights[k]]
        if placed == 0:
            break
    return given
