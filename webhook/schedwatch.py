"""Whether the scheduler GPU pods would be handed to is running, from the Lease it renews.

A pod whose ``spec.schedulerName`` names a scheduler that does not run waits in Pending with no
event and no condition: nothing else reads it. kube-scheduler's leader renews a Lease every few
seconds (``leaderElection`` in its configuration), so the webhook watches that one Lease and
sets ``admission.scheduler_name`` on a pod only while it is renewed; otherwise the pod keeps its
own scheduler and the user is told why. Kept apart from :mod:`webhook.mutation` so that
``fracgpu review`` never imports the Kubernetes client.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from core.informer import EventType, Informer
from core.kube import LEASES

# kube-scheduler's default lease duration; a Lease that does not say uses it.
DEFAULT_LEASE_S = 15
# Renewals can be late by a retry period or two before the standby takes over.
SLACK_S = 10


class SchedulerPresence:
    """The last state of the scheduler's Lease, and what it says about the scheduler now."""

    def __init__(self, lease: str, clock: Callable[[], float] = time.time) -> None:
        self.namespace, _, self.name = lease.partition("/")
        self._clock = clock
        self._spec: Mapping[str, Any] | None = None

    @property
    def lease(self) -> str:
        return f"{self.namespace}/{self.name}"

    def on_event(self, kind: EventType, lease: Mapping[str, Any]) -> None:
        meta = lease.get("metadata") or {}
        if meta.get("name") != self.name:
            return
        spec = lease.get("spec")
        self._spec = None if kind == "DELETED" or not isinstance(spec, dict) else spec

    def not_running(self) -> str | None:
        """Why the scheduler is not running, or None while its leader renews the Lease."""
        spec = self._spec
        if spec is None:
            return f"its Lease {self.lease} does not exist"
        if not spec.get("holderIdentity"):
            return f"its Lease {self.lease} has no holder"
        renewed = _seconds(spec.get("renewTime"))
        if renewed is None:
            return f"its Lease {self.lease} has never been renewed"
        duration = spec.get("leaseDurationSeconds")
        if not isinstance(duration, int) or duration <= 0:
            duration = DEFAULT_LEASE_S
        age = self._clock() - renewed
        if age > duration + SLACK_S:
            return f"its Lease {self.lease} was last renewed {age:.0f} s ago"
        return None


def scheduler_informer(api: Any, presence: SchedulerPresence) -> Informer:
    """An informer on the one Lease; start it, then ``presence`` follows the scheduler."""
    return Informer(
        api,
        LEASES,
        namespace=presence.namespace,
        field_selector=f"metadata.name={presence.name}",
        handler=presence.on_event,
        name="scheduler-lease",
    )


def _seconds(raw: object) -> float | None:
    if not isinstance(raw, str) or not raw:
        return None
    try:
        return datetime.fromisoformat(raw).timestamp()
    except ValueError:
        return None
