"""When the usage controller passes over a namespace again: its timers and its throttle.

Two clocks decide it besides events. A namespace with pending admissions, or an ``unmatched``
aggregate, falls due when the oldest of them passes the grace, even if no event comes (the pod
of an admission may never appear). And a namespace is passed over at most once per
``min_interval_s`` unless a quota there waits to be counted: under a burst every admission
changes the quota, and each controller write would make the webhooks' next write conflict.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from datetime import datetime, timedelta

from quota.ledger import Ledger

# Past the grace by a little, so that the pass due then finds the admission older than it.
_MARGIN = timedelta(milliseconds=10)


class Pacing:
    def __init__(
        self,
        *,
        grace: timedelta,
        min_interval_s: float,
        clock: Callable[[], datetime],
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.grace = grace
        self.min_interval_s = min_interval_s
        self.clock = clock
        self.monotonic = monotonic
        # Per namespace: when its next pending admission or unmatched aggregate falls due.
        self.due: dict[str, datetime] = {}
        # Per namespace: when it was last passed over (monotonic).
        self.last: dict[str, float] = {}

    def wait_s(self, left: float) -> float:
        """How long to wait for events before the next namespace falls due (at most ``left``)."""
        due = min(self.due.values(), default=None)
        if due is not None:
            left = min(left, max(0.0, (due - self.clock()).total_seconds()))
        return left

    def fallen_due(self) -> list[str]:
        at = self.clock()
        return [namespace for namespace, when in self.due.items() if when <= at]

    def may_pass(self, namespace: str, *, urgent: bool) -> bool:
        """Whether to pass over ``namespace`` now; if not, it falls due when it may."""
        since = self.monotonic() - self.last.get(namespace, -math.inf)
        if not urgent and since < self.min_interval_s:
            later = self.clock() + timedelta(seconds=self.min_interval_s - since)
            self.due[namespace] = min(self.due.get(namespace, later), later)
            return False
        self.last[namespace] = self.monotonic()
        return True

    def passing(self, namespace: str | None) -> None:
        """A pass over ``namespace`` (None: all of them) starts: what was due is being done."""
        if namespace is not None:
            self.due.pop(namespace, None)
        else:
            self.due.clear()

    def schedule(self, namespace: str, ledger: Ledger) -> None:
        """Remember when this namespace must be looked at again even if nothing happens."""
        times = [entry.at for entry in ledger.pending]
        if not ledger.unmatched.empty and ledger.unmatched_newest is not None:
            times.append(ledger.unmatched_newest)
        if not times:
            return
        due = min(times) + self.grace + _MARGIN
        current = self.due.get(namespace)
        if current is None or due < current:
            self.due[namespace] = due
