"""Whether the usage controller is behind, as admission sees it, and what admission says then.

Only the controller matches admissions to pods and releases what ended pods held. An admission
still unmatched after ``stale_after_s`` means it is not doing that work: admission then says so
in the denial text, on the quota (a ``ControllerActive=False`` condition, in the write it makes
anyway), in a metric and, once per quota, in the log. Without a controller (embedded mode)
admissions are never matched, and nothing is said.
"""

from __future__ import annotations

import logging
from datetime import datetime

from quota import messages
from quota.ledger import Violation
from quota.metrics import QuotaMetrics
from quota.model import CONTROLLER_ACTIVE, Condition, GPUQuota, QuotaStatus, now

log = logging.getLogger(__name__)


class Staleness:
    def __init__(
        self, metrics: QuotaMetrics, *, controller: bool = True, stale_after_s: float = 60.0
    ) -> None:
        self.metrics = metrics
        self.controller = controller
        self.stale_after_s = stale_after_s
        self._stale: set[tuple[str, str]] = set()  # quotas already reported as unmatched

    def unmatched_since(self, quota: GPUQuota) -> datetime | None:
        """The oldest admission still unmatched, when it is older than ``stale_after_s``."""
        if not self.controller:
            return None
        status = quota.status
        times = [p.at for p in status.pending]
        if status.unmatched is not None and status.unmatched.newest is not None:
            times.append(status.unmatched.newest)
        if not times:
            return None
        oldest = min(times)
        return oldest if (now() - oldest).total_seconds() > self.stale_after_s else None

    def exceeded(self, quota: GPUQuota, violation: Violation) -> str:
        """The denial text, which names a controller that is behind: what ended pods held may
        still be charged."""
        message = messages.exceeded(violation)
        since = self.unmatched_since(quota)
        if since is not None:
            message += messages.controller_behind(since)
        return message

    def flag(self, quota: GPUQuota, status: QuotaStatus) -> QuotaStatus:
        """Say on the quota, in the write admission makes anyway, that the controller is not
        matching admissions to pods (so nothing that ended is released); log it once."""
        since = self.unmatched_since(quota)
        key = (quota.namespace, quota.name)
        self.metrics.unmatched_age.labels(*key).set(
            0 if since is None else (now() - since).total_seconds()
        )
        if since is None:
            self._stale.discard(key)
            return status
        if key not in self._stale:
            self._stale.add(key)
            log.warning(
                "quota admissions are not being matched to pods: is the quota controller running?",
                extra={"namespace": key[0], "quota": key[1], "unmatched_since": since.isoformat()},
            )
        return status.with_condition(
            Condition(
                type=CONTROLLER_ACTIVE,
                status="False",
                reason="AdmissionsUnmatched",
                message=messages.controller_behind(since).lstrip("; "),
                last_transition_time=now(),
            )
        )
