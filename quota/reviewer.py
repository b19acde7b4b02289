"""The ``/validate`` reviewer: GPU quota for pod CREATE, on the canonical form.

The validating webhook runs after every mutation, so the pod it sees carries
``fracgpu.io/core`` and ``fracgpu.io/memory`` and, since kube-apiserver fills them before
validating admission, its final name and UID: the admission is recorded under
that UID. Anything that is not the creation of a pod holding a GPU is allowed untouched, so
pods without GPU are never affected by quota, whatever the state of the API server.
"""

from __future__ import annotations

import time
from typing import Any

from core import dra
from core.admission import AdmissionRequest, AdmissionResponse
from core.kube import KubeError
from quota.claims import TEMPLATE, ClaimSpecs, claim_refs
from quota.demand import CardMemory, Demand, pod_demand
from quota.forward import Forwarder
from quota.messages import unverifiable
from quota.metrics import QuotaMetrics
from quota.reserver import Reserver


class QuotaReviewer:
    def __init__(
        self,
        reserver: Reserver,
        metrics: QuotaMetrics,
        card_memory: CardMemory | None = None,
        claims: ClaimSpecs | None = None,
        *,
        forwarder: Forwarder | None = None,
    ) -> None:
        self.reserver = reserver
        self.forwarder = forwarder
        self.metrics = metrics
        self.card_memory = card_memory
        self.claims = claims

    async def __call__(self, request: AdmissionRequest) -> AdmissionResponse:
        if (
            request.operation != "CREATE"
            or request.kind.kind != "Pod"
            or request.kind.group != ""
            or request.sub_resource
        ):
            return AdmissionResponse.allow(request.uid, label="not-pod-create")
        pod: dict[str, Any] = request.object or {}
        refs = claim_refs(pod) if self.claims is not None else []
        if refs:
            assert self.claims is not None
            try:
                await self.claims.load(refs)
            except (KubeError, OSError, TimeoutError) as exc:
                why = f"the pod's ResourceClaims could not be read ({exc})"
                message = unverifiable(request.namespace or "default", Demand(0, 0), why)
                return AdmissionResponse.deny(request.uid, message, label="quota-unverifiable")
        demand = pod_demand(pod, self.card_memory, self.claims)
        if demand is None:
            return AdmissionResponse.allow(request.uid, label="no-gpu")
        if request.dry_run and _only_unmade_templates(demand):
            # A dry run makes no claim template, and another webhook replica planned this one:
            # nothing is reserved either way, so say what was not checked instead of refusing.
            warning = (
                "GPU quota was not checked for this dry run: its claim templates "
                f"({', '.join(demand.missing_claims)}) are made only when the pod is created"
            )
            return AdmissionResponse.allow(request.uid, warnings=[warning], label="quota-dry-run")
        meta = pod.get("metadata") if isinstance(pod.get("metadata"), dict) else {}
        assert isinstance(meta, dict)
        namespace = request.namespace or str(meta.get("namespace") or "default")
        # The UID is set before validating admission; a review without one (offline tools)
        # falls back to the review's own UID, unique per call.
        uid = str(meta.get("uid") or request.uid)
        started = time.perf_counter()
        decision = None
        if self.forwarder is not None and not request.dry_run:
            decision = await self.forwarder.decide(namespace, uid, request.display_name, demand)
        if decision is None:
            # A decision takes at most quota.timeout_s in all, the try to forward included.
            left = self.reserver.timeout_s - (time.perf_counter() - started)
            decision = await self.reserver.decide(
                namespace,
                uid,
                request.display_name,
                demand,
                dry_run=request.dry_run,
                timeout_s=max(left, 0.001),
            )
        outcome = "allowed" if decision.allowed else "denied"
        self.metrics.admission.labels(outcome).observe(time.perf_counter() - started)
        self.metrics.decisions.labels(outcome, decision.reason).inc()
        label = f"quota-{decision.reason}"
        if decision.allowed:
            return AdmissionResponse.allow(request.uid, label=label)
        return AdmissionResponse.deny(request.uid, decision.message, label=label)


def _only_unmade_templates(demand: Demand) -> bool:
    """Every claim the pod names that could not be read is a template admission makes."""
    prefix = f"{TEMPLATE} {dra.TEMPLATE_PREFIX}"
    return bool(demand.missing_claims) and all(
        missing.startswith(prefix) for missing in demand.missing_claims
    )
