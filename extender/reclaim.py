"""Releasing bookings: only on authoritative, permanent evidence that the pod holds nothing.

A booking for pod UID u in node N's ledger is removed (by compare-and-swap) only when (memo §2.5):

- **R1** u is deleted: the pod by that name is gone, or is another pod (another UID). Absence
  from an informer's cache is never evidence: ask the API server.
- **R2** u is bound to a node M other than N (``spec.nodeName`` is set once, never changed).
- **R3** u has ended (phase Succeeded or Failed, which are final).

Otherwise (**R4**: u exists and is unbound, e.g. a replica died between its booking and its
Binding) the booking is kept: u's retry reuses it. Each of R1-R3 can only become true and then
stays true, so a decision taken on a read stays right however late its write lands; and none
can hold for a pod bound to N and running, so no bound pod ever loses its booking (I2).

The pass is level-triggered and idempotent: run it on pod events, periodically, on any replica;
its timing costs utilisation only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extender.ledger import Ledger
from extender.ledgerstore import CAS_ATTEMPTS, LedgerStore, cas
from extender.pods import PodApi, PodApiDown

TERMINAL = frozenset({"Succeeded", "Failed"})


def evidence(uid: str, node: str, pod: Mapping[str, Any] | None) -> str | None:
    """Why u's booking on ``node`` may go (R1-R3), or None to keep it (R4). ``pod``: what the
    API server answered for the booking's namespace/name (None: 404)."""
    if pod is None:
        return "R1: the pod was deleted"
    meta = pod.get("metadata") if isinstance(pod.get("metadata"), Mapping) else {}
    spec = pod.get("spec") if isinstance(pod.get("spec"), Mapping) else {}
    status = pod.get("status") if isinstance(pod.get("status"), Mapping) else {}
    assert isinstance(meta, Mapping) and isinstance(spec, Mapping) and isinstance(status, Mapping)
    if meta.get("uid") != uid:
        return "R1: the pod was deleted (its name now belongs to another pod)"
    bound = spec.get("nodeName")
    if bound and bound != node:
        return f"R2: the pod is bound to node {bound}"
    if status.get("phase") in TERMINAL:
        return f"R3: the pod has {str(status.get('phase')).lower()}"
    return None


async def release(
    ledgers: LedgerStore, node: str, uids: Mapping[str, str], *, attempts: int = CAS_ATTEMPTS
) -> Ledger:
    """Remove the bookings of ``uids`` (with their evidence) from the node's ledger."""

    def change(ledger: Ledger) -> Ledger:
        present = [u for u in uids if u in ledger.bookings]
        return ledger.without(present) if present else ledger

    return await cas(ledgers, node, change, attempts=attempts)


async def reclaim_node(ledgers: LedgerStore, pods: PodApi, node: str) -> dict[str, str]:
    """One pass over a node's ledger: read each booked pod, release those with evidence.

    A pod that cannot be read now keeps its booking until a later pass. Returns what was
    released, with the evidence.
    """
    ledger = await ledgers.get(node)
    if ledger is None:
        return {}
    gone: dict[str, str] = {}
    for uid, booking in sorted(ledger.bookings.items()):
        try:
            pod = await pods.get(booking.namespace, booking.name)
        except PodApiDown:
            continue
        why = evidence(uid, node, pod)
        if why is not None:
            gone[uid] = why
    if gone:
        await release(ledgers, node, gone)
    return gone
