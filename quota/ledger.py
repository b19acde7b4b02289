"""The quota arithmetic: used + reserved + demand <= limit, in every scope of a quota.

Pure and synchronous, so the stores can run it on a copy read with a resourceVersion and
write the result back with compare-and-swap: whatever the interleaving of webhook replicas,
a reservation is only ever persisted on top of the exact state it was checked against.

A quota has a namespace-wide scope and one scope per GPU model it names. A demand counts
against a model's scope when the pod may land on that model (pinned to it, or not pinned at
all: an unpinned pod may land anywhere, so it is charged against every per-model limit).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from quota.demand import Demand
from quota.model import (
    Amount,
    GPUQuota,
    LimitSpec,
    QuotaSpec,
    QuotaStatus,
    ReservationWire,
    Used,
)


@dataclass(frozen=True, slots=True)
class Usage:
    core: int = 0
    memory_mib: int = 0
    pods: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.core + other.core, self.memory_mib + other.memory_mib, self.pods + other.pods
        )

    @classmethod
    def of(cls, demand: Demand) -> Usage:
        return cls(demand.core, demand.memory_mib, demand.pods)

    @classmethod
    def from_amount(cls, amount: Amount) -> Usage:
        return cls(amount.core, amount.memory_mib, amount.pods)

    def amount(self) -> Amount:
        return Amount.of(self.core, self.memory_mib, self.pods)

    def within(self, limit: LimitSpec) -> bool:
        return (
            (limit.gpu is None or self.core <= limit.gpu)
            and (limit.gpumem is None or self.memory_mib <= limit.gpumem)
            and (limit.pods is None or self.pods <= limit.pods)
        )


ZERO = Usage()


@dataclass(frozen=True, slots=True)
class Reservation:
    """A demand held for a pod UID until the controller sees the pod (or expiry)."""

    uid: str
    pod: str
    demand: Demand
    expires: datetime | None = None

    def wire(self) -> ReservationWire:
        models = None if self.demand.models is None else sorted(self.demand.models)
        return ReservationWire(
            pod=self.pod,
            core=self.demand.core,
            memory_mib=self.demand.memory_mib,
            models=models,
            expires=self.expires,
        )

    @classmethod
    def from_wire(cls, uid: str, wire: ReservationWire) -> Reservation:
        models = None if wire.models is None else frozenset(wire.models)
        return cls(uid, wire.pod, Demand(wire.core, wire.memory_mib, models), wire.expires)


@dataclass(frozen=True, slots=True)
class Violation:
    """Which scope of which quota a demand does not fit, with the numbers for the message."""

    namespace: str
    quota: str
    model: str | None  # None: the namespace-wide scope
    limit: LimitSpec
    charged: Usage  # used + reserved before this pod
    demand: Demand


def sum_usage(demands: Iterable[Demand]) -> Usage:
    total = ZERO
    for demand in demands:
        total = total + Usage.of(demand)
    return total


@dataclass
class Ledger:
    """One quota's arithmetic state: limits, confirmed usage per scope, and reservations."""

    namespace: str
    name: str
    spec: QuotaSpec
    used: Usage = ZERO
    used_models: dict[str, Usage] = field(default_factory=dict)
    reservations: dict[str, Reservation] = field(default_factory=dict)
    # Charged amount per scope, kept up to date by reserve() so that checking a batch of N pods
    # against R reservations costs O(N + R), not O(N * R); dropped when usage is replaced.
    _charged: dict[str | None, Usage] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, quota: GPUQuota) -> Ledger:
        status = quota.status
        return cls(
            quota.namespace,
            quota.name,
            quota.spec,
            Usage.from_amount(status.used),
            {m: Usage.from_amount(a) for m, a in status.used.models.items()},
            {uid: Reservation.from_wire(uid, w) for uid, w in status.reservations.items()},
        )

    def scopes(self) -> list[tuple[str | None, LimitSpec]]:
        return [(None, self.spec), *sorted(self.spec.models.items())]

    def charged(self, model: str | None) -> Usage:
        """What the scope holds now: confirmed use plus every pending reservation in it."""
        cached = self._charged.get(model)
        if cached is None:
            used = self.used if model is None else self.used_models.get(model, ZERO)
            cached = used + sum_usage(
                r.demand for r in self.reservations.values() if model is None or r.demand.on(model)
            )
            self._charged[model] = cached
        return cached

    def check(self, demand: Demand) -> Violation | None:
        """The first scope the demand does not fit, or None when it fits everywhere."""
        for model, limit in self.scopes():
            if model is not None and not demand.on(model):
                continue
            charged = self.charged(model)
            if not (charged + Usage.of(demand)).within(limit):
                return Violation(self.namespace, self.name, model, limit, charged, demand)
        return None

    def holds(self, uid: str) -> bool:
        return uid in self.reservations

    def reserve(self, reservation: Reservation) -> Violation | None:
        """Reserve if it fits (idempotent per UID: a repeated review is not charged twice)."""
        if reservation.uid in self.reservations:
            return None
        violation = self.check(reservation.demand)
        if violation is None:
            self.reservations[reservation.uid] = reservation
            added = Usage.of(reservation.demand)
            for model in list(self._charged):
                if model is None or reservation.demand.on(model):
                    self._charged[model] = self._charged[model] + added
        return violation

    def release(self, uids: Iterable[str]) -> bool:
        """Drop reservations; whether anything changed."""
        changed = False
        for uid in uids:
            changed |= self.reservations.pop(uid, None) is not None
        self._charged.clear()
        return changed

    def set_used(self, demands: Iterable[Demand]) -> None:
        """Replace confirmed usage with the sum of the given pods' demands (the controller)."""
        demands = list(demands)
        self._charged.clear()
        self.used = sum_usage(demands)
        self.used_models = {
            model: sum_usage(d for d in demands if d.on(model)) for model in self.spec.models
        }

    def status(self, base: QuotaStatus) -> QuotaStatus:
        """``base`` with this ledger's usage and reservations (conditions etc. kept)."""
        reserved = sum_usage(r.demand for r in self.reservations.values())
        return base.model_copy(
            update={
                "used": Used(
                    **self.used.amount().model_dump(),
                    models={m: u.amount() for m, u in sorted(self.used_models.items())},
                ),
                "reserved": reserved.amount(),
                "reservations": {uid: r.wire() for uid, r in sorted(self.reservations.items())},
            }
        )
