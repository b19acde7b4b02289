"""A quota decision for one pod, and how a decision about the whole namespace is told to it.

Some outcomes hold for every pod of a namespace at once (no GPUQuota, one that cannot be read,
one not counted yet, the CRD missing); they are found once per batch, then phrased for each pod
with its own demand. So is a decision that could not be verified (the API server out of reach).
"""

from __future__ import annotations

from dataclasses import dataclass

from quota import messages
from quota.demand import Demand


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    message: str = ""
    # A short fixed reason for metrics and logs.
    reason: str = "fits"


def unverifiable(namespace: str, demand: Demand, why: str) -> Decision:
    return Decision(False, messages.unverifiable(namespace, demand, why), "unverifiable")


def explain(namespace: str, demand: Demand, decision: Decision) -> Decision:
    """Phrase a namespace-wide decision (no quota, or an unusable one) for one pod."""
    if decision.reason == "no-quota" and not decision.allowed:
        return Decision(False, messages.no_quota(namespace, demand), "no-quota")
    if decision.reason == "invalid-quota":
        message = messages.invalid_quota(namespace, decision.message)
        return Decision(False, message, "invalid-quota")
    if decision.reason == "no-crd":
        return Decision(False, messages.crd_missing(namespace, demand), "no-crd")
    if decision.reason == "not-counted":
        message = messages.not_counted_for(namespace, demand, decision.message)
        return Decision(False, message, "not-counted")
    return decision
