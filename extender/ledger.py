"""The per-node booking ledger, ``GPUNodeLedger``: what the extender has promised each card.

One cluster-scoped object per node (``metadata.name`` = the node), written only by fracgpu, and
only by compare-and-swap (a PUT carrying the ``resourceVersion`` it was computed from). Its
``spec.bookings`` map a pod's UID to where that pod's containers lie::

    spec:
      bookings:
        <pod uid>: {namespace: team, name: train-0,
                    containers: {main: {cards: [GPU-…], core: 50, memoryBlocks: 32}}}

A booking is written *before* the pod's Binding, and the Binding carries the same placement as
the pod's record (``core.placement``), so every bound pod's record is booked (invariant I2 of the
memo), and no stored version books a card beyond its capacity (I1): every version is computed
from the exact one it replaces and checked by its writer. Neither needs a lease or a clock.

This module is the pure model: reading and writing the object, adding and removing bookings.
The stores (``extender.ledgerstore``) do the I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from core.placement import (
    CardRoom,
    ContainerPlacement,
    PlacementError,
    PlacementRecord,
    booked,
    containers_json,
    overbooked,
    parse_containers,
)
from core.units import DOMAIN

GROUP = DOMAIN
VERSION = "v1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "GPUNodeLedger"
PLURAL = "gpunodeledgers"


class LedgerError(ValueError):
    """A stored ledger fracgpu cannot read; the text names the node and the booking."""


@dataclass(frozen=True, slots=True)
class Booking:
    """One pod's place on a node: its name (for reclaim's look-ups) and its containers'."""

    namespace: str
    name: str
    containers: Mapping[str, ContainerPlacement] = field(default_factory=dict)

    def __hash__(self) -> int:
        return hash((self.namespace, self.name, tuple(sorted(self.containers.items()))))

    def record(self, node: str) -> PlacementRecord:
        """The pod's ``fracgpu.io/placement`` record for this booking on ``node``."""
        return PlacementRecord(node, dict(self.containers))


@dataclass(frozen=True, slots=True)
class Ledger:
    """One node's ledger as read, with the ``resourceVersion`` a write must carry."""

    node: str
    bookings: Mapping[str, Booking] = field(default_factory=dict)
    version: str = ""
    uid: str = ""

    def __hash__(self) -> int:
        return hash((self.node, tuple(sorted(self.bookings.items())), self.version))

    def placements(self, *, exclude: str = "") -> list[ContainerPlacement]:
        """Every booked container but those of pod ``exclude`` (a retried pod's own)."""
        return [
            p for uid, b in self.bookings.items() if uid != exclude for p in b.containers.values()
        ]

    def with_booking(self, uid: str, booking: Booking) -> Ledger:
        return replace(self, bookings={**self.bookings, uid: booking})

    def without(self, uids: Sequence[str]) -> Ledger:
        gone = set(uids)
        return replace(self, bookings={u: b for u, b in self.bookings.items() if u not in gone})

    def overbooked(self, cards: Sequence[CardRoom]) -> list[CardRoom]:
        """The cards this ledger books beyond their capacity (I1: none may be)."""
        return overbooked(booked(cards, self.placements()))


def to_object(ledger: Ledger) -> dict[str, Any]:
    """The ``GPUNodeLedger`` object to write (with its resourceVersion when it has one)."""
    metadata: dict[str, Any] = {"name": ledger.node}
    if ledger.version:
        metadata["resourceVersion"] = ledger.version
    if ledger.uid:
        metadata["uid"] = ledger.uid
    bookings = {
        uid: {"namespace": b.namespace, "name": b.name, "containers": containers_json(b.containers)}
        for uid, b in sorted(ledger.bookings.items())
    }
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": metadata,
        "spec": {"bookings": bookings},
    }


def from_object(obj: Mapping[str, Any]) -> Ledger:
    """Read a stored ``GPUNodeLedger``; LedgerError names the node and what is wrong."""
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), Mapping) else {}
    assert isinstance(meta, Mapping)
    node = str(meta.get("name") or "")
    spec = obj.get("spec") if isinstance(obj.get("spec"), Mapping) else {}
    assert isinstance(spec, Mapping)
    raw = spec.get("bookings")
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        raise LedgerError(f"GPUNodeLedger {node}: spec.bookings is not an object")
    bookings: dict[str, Booking] = {}
    for uid, body in raw.items():
        bookings[str(uid)] = _booking(node, str(uid), body)
    return Ledger(
        node, bookings, str(meta.get("resourceVersion") or ""), str(meta.get("uid") or "")
    )


def _booking(node: str, uid: str, body: object) -> Booking:
    where = f"GPUNodeLedger {node}: booking {uid}"
    if not isinstance(body, Mapping):
        raise LedgerError(f"{where} is not an object")
    namespace, name = body.get("namespace"), body.get("name")
    if not isinstance(namespace, str) or not isinstance(name, str) or not namespace or not name:
        raise LedgerError(f"{where} names no pod (namespace and name)")
    try:
        containers = parse_containers(body.get("containers"))
    except PlacementError as err:
        raise LedgerError(f"{where}: {err}") from None
    return Booking(namespace, name, containers)
