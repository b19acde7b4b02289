"""Prometheus metrics of GPU quota, in a registry the caller owns (the server shares its own)."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from quota.ledger import Ledger, Usage

# Admission with quota makes API calls; the buckets reach into seconds for a slow apiserver.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class QuotaMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        labels = ["namespace", "quota", "resource"]
        self.limit = Gauge(
            "fracgpu_quota_limit",
            "GPUQuota limits (resource: cards, memory_mib, pods), per namespace and quota.",
            labels,
            registry=r,
        )
        self.used = Gauge(
            "fracgpu_quota_used",
            "GPU use counted from existing pods by the controller, per namespace and quota.",
            labels,
            registry=r,
        )
        self.reserved = Gauge(
            "fracgpu_quota_reserved",
            "GPU reserved by admission for pods the controller has not yet counted.",
            labels,
            registry=r,
        )
        self.pending = Gauge(
            "fracgpu_quota_pending_reservations",
            "Reservations waiting for their pod to appear, per namespace and quota.",
            ["namespace", "quota"],
            registry=r,
        )
        self.conflicts = Counter(
            "fracgpu_quota_cas_conflicts",
            "GPUQuota status writes refused with 409 Conflict (re-read and retried).",
            ["component"],
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
            "Reservations released by the controller: confirmed (pod counted), expired (pod "
            "never persisted), ended (pod deleted or finished first), or denied (admission "
            "failed part-way).",
            ["why"],
            registry=r,
        )
        self.reconciles = Counter(
            "fracgpu_quota_reconciles",
            "Controller passes over all GPUQuotas, by result.",
            ["result"],
            registry=r,
        )
        self.leader = Gauge(
            "fracgpu_quota_leader",
            "1 while this replica holds the quota controller's Lease.",
            registry=r,
        )

    def observe(self, ledger: Ledger) -> None:
        """Publish one quota's limits, usage and reservations."""
        ns, name = ledger.namespace, ledger.name
        spec = ledger.spec
        reserved = ledger.charged(None)
        reserved = Usage(
            reserved.core - ledger.used.core,
            reserved.memory_mib - ledger.used.memory_mib,
            reserved.pods - ledger.used.pods,
        )
        for resource, limit, used, held in (
            ("cards", spec.gpu, ledger.used.core, reserved.core),
            ("memory_mib", spec.gpumem, ledger.used.memory_mib, reserved.memory_mib),
            ("pods", spec.pods, ledger.used.pods, reserved.pods),
        ):
            scale = 100 if resource == "cards" else 1
            if limit is not None:
                self.limit.labels(ns, name, resource).set(limit / scale)
            self.used.labels(ns, name, resource).set(used / scale)
            self.reserved.labels(ns, name, resource).set(held / scale)
        self.pending.labels(ns, name).set(len(ledger.reservations))

    def forget(self, namespace: str, name: str) -> None:
        for resource in ("cards", "memory_mib", "pods"):
            for gauge in (self.limit, self.used, self.reserved):
                with contextlib.suppress(KeyError):
                    gauge.remove(namespace, name, resource)
        with contextlib.suppress(KeyError):
            self.pending.remove(namespace, name)
