"""Prometheus metrics of GPU quota, in a registry the caller owns (the server shares its own)."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from quota.ledger import Ledger

# Admission with quota makes API calls; the buckets reach into seconds for a slow apiserver.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class QuotaMetrics:
    """Every quota metric, declared by family in the order the registry lists them."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._declare_usage(registry)
        self._declare_decisions(registry)
        self._declare_control(registry)
        self._declare_forwarding(registry)

    def _declare_usage(self, r: CollectorRegistry) -> None:
        """What each quota limits and charges, labelled by quota (forgotten with it)."""
        labels = ["namespace", "quota", "resource"]
        self.limit = Gauge(
            "fracgpu_quota_limit",
            "GPUQuota limits (resource: cards, memory_mib, pods), per namespace and quota.",
            labels,
            registry=r,
        )
        self.used = Gauge(
            "fracgpu_quota_used",
            "GPU a quota charges (counted pods plus admissions not yet seen as pods).",
            labels,
            registry=r,
        )
        self.pending = Gauge(
            "fracgpu_quota_pending_admissions",
            "Admissions recorded one by one in a GPUQuota that the controller has not yet "
            "matched to pods (bounded by pending_limit; older ones are aggregated).",
            ["namespace", "quota"],
            registry=r,
        )
        self.unmatched_age = Gauge(
            "fracgpu_quota_unmatched_admission_age_seconds",
            "Age of the oldest admission not matched to a pod, once it is older than "
            "stale_after_s (0 otherwise): above 0, the quota controller is not running.",
            ["namespace", "quota"],
            registry=r,
        )

    def _declare_decisions(self, r: CollectorRegistry) -> None:
        """What admission and the controller did: writes, decisions, releases, passes."""
        self.conflicts = Counter(
            "fracgpu_quota_cas_conflicts",
            "GPUQuota status writes refused with 409 Conflict (re-read and retried).",
            ["component"],
            registry=r,
        )
        self.first_counts = Counter(
            "fracgpu_quota_counted_by_admission",
            "GPUQuotas that a replica counted itself because pods waited on them and no "
            "controller had counted them (the leader crashed, or is slow).",
            registry=r,
        )
        self.admission = Histogram(
            "fracgpu_quota_admission_duration_seconds",
            "Time to decide quota for one GPU pod, reservation write included.",
            ["outcome"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.decisions = Counter(
            "fracgpu_quota_decisions",
            "Quota decisions for GPU pods, by outcome and reason.",
            ["outcome", "reason"],
            registry=r,
        )
        self.released = Counter(
            "fracgpu_quota_reservations_released",
            "Admissions the controller matched or dropped: confirmed (pod seen), expired "
            "(pod never persisted), ended (pod deleted or finished first), unmatched (the "
            "aggregate of older admissions, matched or expired), or denied (admission failed "
            "part-way and withdrew it).",
            ["why"],
            registry=r,
        )
        self.reconciles = Counter(
            "fracgpu_quota_reconciles",
            "Controller passes over all GPUQuotas, by result.",
            ["result"],
            registry=r,
        )

    def _declare_control(self, r: CollectorRegistry) -> None:
        """Whether quota can work at all: the Lease, the controller, the CRD."""
        self.leader = Gauge(
            "fracgpu_quota_leader",
            "1 while this replica holds the quota controller's Lease.",
            registry=r,
        )
        self.crd_installed = Gauge(
            "fracgpu_quota_crd_installed",
            "1 when the GPUQuota CRD is installed; 0 while it is not (GPU pods are denied).",
            registry=r,
        )
        self.controller_seen = Gauge(
            "fracgpu_quota_controller_seen",
            "1 while this replica sees some replica hold the quota controller's Lease (renewed "
            "within its duration); 0 means no controller runs anywhere.",
            registry=r,
        )
        self.lease_errors = Counter(
            "fracgpu_quota_lease_errors",
            "Lease requests that failed with something other than a lost race, by HTTP status "
            "(or 'network'): 404 usually means the lease namespace does not exist, 403 RBAC.",
            ["code"],
            registry=r,
        )

    def _declare_forwarding(self, r: CollectorRegistry) -> None:
        """Decisions sent to the leader, and made there for other replicas."""
        self.forwarded = Counter(
            "fracgpu_quota_forwarded",
            "Quota decisions this replica sent to the leader, by outcome: 'answered', or "
            "'fallback' when the leader could not be reached and this replica decided itself.",
            ["outcome"],
            registry=r,
        )
        self.decided_for_peers = Counter(
            "fracgpu_quota_decided_for_peers",
            "Quota decisions this replica made for another replica that forwarded them.",
            registry=r,
        )

    def observe(self, ledger: Ledger) -> None:
        """Publish one quota's limits, usage and pending admissions."""
        ns, name = ledger.namespace, ledger.name
        spec = ledger.spec
        used = ledger.charged(None)
        for resource, limit, value in (
            ("cards", spec.gpu, used.core),
            ("memory_mib", spec.gpumem, used.memory_mib),
            ("pods", spec.pods, used.pods),
        ):
            scale = 100 if resource == "cards" else 1
            if limit is not None:
                self.limit.labels(ns, name, resource).set(limit / scale)
            self.used.labels(ns, name, resource).set(value / scale)
        self.pending.labels(ns, name).set(len(ledger.pending))

    def forget(self, namespace: str, name: str) -> None:
        for resource in ("cards", "memory_mib", "pods"):
            for gauge in (self.limit, self.used):
                with contextlib.suppress(KeyError):
                    gauge.remove(namespace, name, resource)
        for labelled in (self.pending, self.unmatched_age):
            with contextlib.suppress(KeyError):
                labelled.remove(namespace, name)
