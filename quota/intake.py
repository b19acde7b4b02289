"""What the watches tell the usage controller between two passes: which namespaces changed.

Pod and GPUQuota events only mark namespaces dirty (a pass recounts a whole namespace, never
applies an event as an increment). Beside that, the intake remembers what each event made cheap
to know later: the demand of each pod as of its last event (each recount reads every pod of its
namespace: computing it once per change keeps the recount linear in changes, not in pods), and
the UIDs of pods seen deleted, so that an admission whose pod came and went between two passes
is released at once instead of after the grace.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from quota.claims import ClaimSpecs
from quota.demand import CardMemory, Demand, pod_demand
from quota.model import GPUQuota, QuotaError

# Pod UIDs seen deleted, remembered so that an admission whose pod came and went between two
# passes is released at once instead of after the grace. Bounded: older ones fall back to it.
DELETED_MEMORY = 10_000

# What to drop when a GPUQuota is deleted: (namespace, name, uid).
ForgetQuota = Callable[[str, str, str], None]


class EventIntake:
    """The informers' handlers for pods and GPUQuotas, and what they leave for the next pass."""

    def __init__(
        self,
        forget_quota: ForgetQuota,
        *,
        card_memory: CardMemory | None = None,
        claims: ClaimSpecs | None = None,
        deleted_memory: int = DELETED_MEMORY,
    ) -> None:
        self.card_memory = card_memory
        self.claims = claims
        self.deleted_memory = deleted_memory
        self._forget_quota = forget_quota
        self.dirty: set[str] = set()
        # Namespaces whose pass must not wait for min_interval_s (admission waits on them).
        self.urgent: set[str] = set()
        self.wake = asyncio.Event()
        self.deleted: OrderedDict[str, None] = OrderedDict()
        self.demands: dict[str, Demand | None] = {}  # per pod UID, as of its last event

    def on_pod(self, kind: str, pod: Mapping[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        namespace = meta.get("namespace")
        uid = str(meta.get("uid") or "")
        demand = pod_demand(pod, self.card_memory, self.claims)
        # A pod whose claims are not read yet is computed at the recount, which reads them.
        if kind == "DELETED" or (demand is not None and demand.missing_claims):
            self.demands.pop(uid, None)
        else:
            self.demands[uid] = demand
        if namespace and demand is not None:
            if kind == "DELETED":
                self.deleted[uid] = None
                while len(self.deleted) > self.deleted_memory:
                    self.deleted.popitem(last=False)
            self.mark(str(namespace))

    def on_quota(self, kind: str, raw: Mapping[str, Any]) -> None:
        meta = raw.get("metadata") or {}
        namespace = str(meta.get("namespace") or "")
        if kind == "DELETED":
            self._forget_quota(namespace, str(meta.get("name") or ""), str(meta.get("uid") or ""))
            return
        status = raw.get("status") or {}
        try:
            counted = GPUQuota(raw).counted()
        except QuotaError:
            counted = False
        # A new or changed quota is counted at once (admission waits for it); admissions
        # the controller has not matched yet are looked at as soon as they are written.
        if not counted:
            self.urgent.add(namespace)
        if not counted or status.get("pending") or status.get("unmatched"):
            self.mark(namespace)

    def mark(self, namespace: str) -> None:
        self.dirty.add(namespace)
        self.wake.set()

    def take(self) -> tuple[set[str], set[str]]:
        """The namespaces to pass over now, and which of them are urgent; both start afresh."""
        self.wake.clear()
        dirty, self.dirty = self.dirty, set()
        urgent, self.urgent = self.urgent, set()
        return dirty, urgent
