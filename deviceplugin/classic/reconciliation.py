"""The ledger aligned with kubelet's PodResources listing: what it no longer lists is freed, what
it lists that the ledger does not know is adopted.

kubelet never tells a device plugin that a pod ended, so a listing is the only way to learn it.
A listing that misses an allocation is only believed when a second listing, at least
``confirm_s`` later, misses it too: a kubelet that has just restarted can answer with an empty
or partial list while its containers still run.

It runs every pass over a full node (thousands of IDs) while RPCs wait for the interpreter lock,
so the common case, a container listed exactly as recorded, is settled with set operations that
run per ID in C, not in Python bytecode.

Not thread-safe: the allocator calls :func:`align` under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from itertools import chain

from deviceplugin.classic.allocation import Allocation
from deviceplugin.classic.ledger import Ledger

ADOPTED = 0.0
"""``Allocation.created`` of a container learnt from PodResources: old enough to be freed."""

CardsOf = Callable[[Collection[str]], Collection[int] | None]


@dataclass(frozen=True, slots=True)
class Reconciled:
    """What one reconciliation changed."""

    freed: list[Allocation]
    adopted: list[Allocation]
    unconfirmed: int  # allocations the listing missed, kept until a second listing agrees


@dataclass(frozen=True, slots=True)
class Listing:
    """One PodResources listing: each container's (core IDs, memory IDs), and all their IDs."""

    containers: list[tuple[frozenset[str], frozenset[str]]]
    ids: set[str]

    @classmethod
    def of(cls, listed: Iterable[tuple[Collection[str], Collection[str]]]) -> Listing:
        """Built before the allocator's lock is taken: it needs none."""
        containers = [(frozenset(c), frozenset(m)) for c, m in listed if c or m]
        ids: set[str] = set()
        for core, memory in containers:
            ids |= core
            ids |= memory
        return cls(containers, ids)


def align(
    ledger: Ledger,
    listing: Listing,
    listed_at: float,
    *,
    grace_s: float,
    confirm_s: float,
    may_free: bool,
    cards_of: CardsOf | None,
) -> Reconciled:
    """Free the allocations none of whose IDs are listed, once confirmed; adopt the listed
    containers that are unknown, on the cards ``cards_of`` (their core IDs) says they run on.

    An allocation younger than ``grace_s`` at ``listed_at`` is never freed (an Allocate can race
    the List), nor any when ``may_free`` is false.
    """
    freed = _free_missing(
        ledger, listing, listed_at, grace_s=grace_s, confirm_s=confirm_s, may_free=may_free
    )
    adopted = _adopt_unknown(ledger, listing, cards_of)
    return Reconciled(freed, adopted, len(ledger.missing))


def _free_missing(
    ledger: Ledger,
    listing: Listing,
    listed_at: float,
    *,
    grace_s: float,
    confirm_s: float,
    may_free: bool,
) -> list[Allocation]:
    listed_ids = listing.ids
    freed: list[Allocation] = []
    for key, allocation in list(ledger.allocations.items()):
        if not listed_ids.isdisjoint(allocation.core) or not listed_ids.isdisjoint(
            allocation.memory
        ):
            ledger.missing.pop(key, None)
            continue
        if allocation.created > listed_at - grace_s:
            continue
        if not may_free:  # a listing that cannot be believed confirms nothing either
            ledger.missing.pop(key, None)
            continue
        first_missed = ledger.missing.setdefault(key, listed_at)
        if listed_at - first_missed < confirm_s:
            continue
        freed.append(allocation)
        ledger.drop(key, why="no longer listed by kubelet")
    return freed


def _adopt_unknown(ledger: Ledger, listing: Listing, cards_of: CardsOf | None) -> list[Allocation]:
    adopted: list[Allocation] = []
    owner = ledger.owner
    for core, memory in listing.containers:
        holder = owner.get(next(iter(core or memory)))
        record = ledger.allocations.get(holder) if holder is not None else None
        if (
            record is not None
            and core == frozenset(record.core)
            and memory == frozenset(record.memory)
            and set(map(owner.get, chain(core, memory))) == {holder}
        ):
            continue
        # Unknown, or held differently than recorded (kubelet reassigned IDs while this plugin
        # was not looking): kubelet's listing wins.
        for stale in {owner[i] for i in (*core, *memory) if i in owner}:
            ledger.drop(stale, why="superseded by PodResources")
        hint = cards_of(core) if cards_of is not None and core else None
        adopted.append(ledger.adopted(core, memory, hint, created=ADOPTED))
    return adopted
