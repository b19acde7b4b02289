"""The quota arithmetic: charged + demand <= limit, in every scope of a quota.

Pure and synchronous, so the stores can run it on a copy read with a resourceVersion and
write the result back with compare-and-swap: whatever the interleaving of webhook replicas,
an admission is only ever persisted on top of the exact state it was checked against.

What a quota charges is one aggregate per scope, ``status.used``, as in Kubernetes' own
ResourceQuota: admission adds each admitted pod to it, the controller replaces it with a
recount. The recount needs to know which admissions it cannot see as pods yet (a pod is
persisted after admission, and reaches the controller's watch later still), so admission
also records the most recent ones in ``pending`` (at most ``pending_limit``, oldest first)
and folds older ones into one aggregate, ``unmatched``. The object therefore stays the same
size whatever the number of pods; docs/quota.md explains why the recount is safe.

A quota has a namespace-wide scope and one scope per GPU model it names. A demand counts
against a model's scope when the pod may land on that model (pinned to it, or not pinned at
all: an unpinned pod may land anywhere, so it is charged against every per-model limit).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from quota.demand import Demand
from quota.model import (
    Amount,
    GPUQuota,
    LimitSpec,
    PendingWire,
    QuotaSpec,
    QuotaStatus,
    UnmatchedWire,
    Used,
)

# Pinned to more models than this, a pending entry records "any model": charged against
# every per-model limit, which over-counts (safe) and keeps the entry small.
MAX_PENDING_MODELS = 8
DEFAULT_PENDING_LIMIT = 8
MAX_POD_NAME = 253  # the CRD's bound, a pod name's longest


@dataclass(frozen=True, slots=True)
class Usage:
    core: int = 0
    memory_mib: int = 0
    pods: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.core + other.core, self.memory_mib + other.memory_mib, self.pods + other.pods
        )

    def minus(self, other: Usage) -> Usage:
        """Subtraction that never goes below zero in any component."""
        return Usage(
            max(0, self.core - other.core),
            max(0, self.memory_mib - other.memory_mib),
            max(0, self.pods - other.pods),
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

    @property
    def empty(self) -> bool:
        return self == ZERO


ZERO = Usage()


@dataclass(frozen=True, slots=True)
class Pending:
    """An admission not yet matched to a pod: its pod UID, name, demand and time."""

    uid: str
    pod: str
    demand: Demand
    at: datetime

    def wire(self) -> PendingWire:
        models = self.demand.models
        listed = None if models is None or len(models) > MAX_PENDING_MODELS else sorted(models)
        return PendingWire(
            uid=self.uid,
            pod=self.pod[:MAX_POD_NAME],  # a display name ("x-<generated>") may be longer
            core=self.demand.core,
            memory_mib=self.demand.memory_mib,
            models=listed,
            at=self.at,
        )

    @classmethod
    def from_wire(cls, wire: PendingWire) -> Pending:
        models = None if wire.models is None else frozenset(wire.models)
        return cls(wire.uid, wire.pod, Demand(wire.core, wire.memory_mib, models), wire.at)


@dataclass
class Scoped:
    """An amount in the namespace-wide scope and in each per-model scope of a spec."""

    total: Usage = ZERO
    models: dict[str, Usage] = field(default_factory=dict)

    @classmethod
    def of(cls, demands: Iterable[Demand], spec: QuotaSpec) -> Scoped:
        scoped = cls(ZERO, {model: ZERO for model in spec.models})
        for demand in demands:
            scoped.add(demand, spec)
        return scoped

    def get(self, model: str | None) -> Usage:
        return self.total if model is None else self.models.get(model, ZERO)

    def add(self, demand: Demand, spec: QuotaSpec) -> None:
        usage = Usage.of(demand)
        self.total = self.total + usage
        for model in spec.models:  # every model of the spec gets an entry, zero or not
            self.models[model] = self.models.get(model, ZERO) + (
                usage if demand.on(model) else ZERO
            )

    def remove(self, demand: Demand, spec: QuotaSpec) -> None:
        usage = Usage.of(demand)
        self.total = self.total.minus(usage)
        for model in spec.models:
            self.models[model] = self.models.get(model, ZERO).minus(
                usage if demand.on(model) else ZERO
            )

    def plus(self, other: Scoped, spec: QuotaSpec) -> Scoped:
        return Scoped(
            self.total + other.total,
            {m: self.get(m) + other.get(m) for m in spec.models},
        )

    @property
    def empty(self) -> bool:
        return self.total.empty and all(u.empty for u in self.models.values())

    @classmethod
    def from_wire(cls, used: Used, spec: QuotaSpec) -> Scoped:
        total = Usage.from_amount(used)
        # A model the spec names but the status does not (the spec changed): its share is at
        # most the namespace-wide amount, so that is what it is taken to be.
        return cls(
            total,
            {
                m: Usage.from_amount(used.models[m]) if m in used.models else total
                for m in spec.models
            },
        )

    def used(self) -> Used:
        return Used(
            **self.total.amount().model_dump(),
            models={m: u.amount() for m, u in sorted(self.models.items())},
        )


@dataclass(frozen=True, slots=True)
class Violation:
    """Which scope of which quota a demand does not fit, with the numbers for the message."""

    namespace: str
    quota: str
    model: str | None  # None: the namespace-wide scope
    limit: LimitSpec
    charged: Usage  # what the scope held before this pod
    demand: Demand


@dataclass
class Ledger:
    """One quota's arithmetic state: limits, what is charged, and the unmatched admissions."""

    namespace: str
    name: str
    spec: QuotaSpec
    used: Scoped = field(default_factory=Scoped)
    pending: list[Pending] = field(default_factory=list)  # oldest first
    unmatched: Scoped = field(default_factory=Scoped)
    unmatched_newest: datetime | None = None
    pending_limit: int = DEFAULT_PENDING_LIMIT

    @classmethod
    def of(cls, quota: GPUQuota, *, pending_limit: int = DEFAULT_PENDING_LIMIT) -> Ledger:
        status = quota.status
        unmatched = status.unmatched
        return cls(
            quota.namespace,
            quota.name,
            quota.spec,
            Scoped.from_wire(status.used, quota.spec),
            [Pending.from_wire(p) for p in status.pending],
            Scoped() if unmatched is None else Scoped.from_wire(unmatched, quota.spec),
            None if unmatched is None else unmatched.newest,
            pending_limit,
        )

    def scopes(self) -> list[tuple[str | None, LimitSpec]]:
        return [(None, self.spec), *sorted(self.spec.models.items())]

    def charged(self, model: str | None) -> Usage:
        """What the scope holds: counted pods plus admissions not yet matched to pods."""
        return self.used.get(model)

    def check(self, demand: Demand) -> Violation | None:
        """The first scope the demand does not fit, or None when it fits everywhere."""
        for model, limit in self.scopes():
            if model is not None and not demand.on(model):
                continue
            charged = self.charged(model)
            unsized = bool(demand.unsized_cards) and limit.gpumem is not None
            unknown = bool(demand.missing_claims)
            if unsized or unknown or not (charged + Usage.of(demand)).within(limit):
                return Violation(self.namespace, self.name, model, limit, charged, demand)
        return None

    def holds(self, uid: str) -> bool:
        return any(p.uid == uid for p in self.pending)

    def admit(self, uid: str, pod: str, demand: Demand, at: datetime) -> Violation | None:
        """Charge the demand if it fits (idempotent per UID while the admission is pending:
        a repeated review is not charged twice)."""
        if self.holds(uid):
            return None
        violation = self.check(demand)
        if violation is None:
            self.used.add(demand, self.spec)
            self.pending.append(Pending(uid, pod, demand, at))
            self._fold()
        return violation

    def _fold(self) -> None:
        """Keep ``pending`` bounded: the oldest entries join the ``unmatched`` aggregate."""
        while len(self.pending) > self.pending_limit:
            oldest = self.pending.pop(0)
            self.unmatched.add(oldest.demand, self.spec)
            if self.unmatched_newest is None or oldest.at > self.unmatched_newest:
                self.unmatched_newest = oldest.at

    def withdraw(self, uids: Iterable[str]) -> bool:
        """Undo admissions of pods that were denied after all; whether anything changed.

        An admission already folded into ``unmatched`` stays charged until the controller
        drops it (an over-count, never an under-count)."""
        gone = set(uids)
        kept = []
        for entry in self.pending:
            if entry.uid in gone:
                self.used.remove(entry.demand, self.spec)
            else:
                kept.append(entry)
        changed = len(kept) != len(self.pending)
        self.pending = kept
        return changed

    def recount(
        self,
        live: Mapping[str, Demand],
        pending: list[Pending],
        unmatched: Scoped | None,
    ) -> None:
        """The controller's recount: ``used`` = the pods that exist and hold GPU, plus the
        admissions it still cannot see as pods (``pending`` kept, ``unmatched`` or None)."""
        self.pending = list(pending)
        if unmatched is None or unmatched.empty:
            self.unmatched, self.unmatched_newest = Scoped(), None
        else:
            self.unmatched = unmatched
        used = Scoped.of(live.values(), self.spec)
        used = used.plus(Scoped.of((p.demand for p in self.pending), self.spec), self.spec)
        self.used = used.plus(self.unmatched, self.spec)

    def status(self, base: QuotaStatus) -> QuotaStatus:
        """``base`` with this ledger's aggregates (conditions etc. kept)."""
        unmatched = None
        if not self.unmatched.empty:
            unmatched = UnmatchedWire(
                **self.unmatched.used().model_dump(), newest=self.unmatched_newest
            )
        return base.model_copy(
            update={
                "used": self.used.used(),
                "pending": [p.wire() for p in self.pending],
                "unmatched": unmatched,
            }
        )
