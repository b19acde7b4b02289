"""Prometheus metrics of the DRA kubelet plugin, in the registry its caller passes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from deviceplugin.shared.services import NodeMetrics

PREFIX = "fracgpu_dra_plugin"


class DraMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        # health and the node guard (shared/services.py), under this agent's prefix
        self.node = NodeMetrics(registry, PREFIX)
        self.registered = Gauge(
            f"{PREFIX}_registered",
            "1 while kubelet has the plugin registered",
            registry=self.registry,
        )
        self.registrations = Counter(
            f"{PREFIX}_registrations",
            "Registrations kubelet confirmed (a kubelet restart adds one)",
            registry=self.registry,
        )
        self.prepared = Gauge(
            f"{PREFIX}_prepared_claims", "Claims prepared on this node", registry=self.registry
        )
        self.failures = Counter(
            f"{PREFIX}_claim_failures",
            "Claims answered to kubelet with an error",
            ["rpc"],
            registry=self.registry,
        )
        self.rpc_seconds = Histogram(
            f"{PREFIX}_rpc_seconds",
            "Time to serve a kubelet DRA call (claim reads included)",
            ["rpc"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 5),
            registry=self.registry,
        )
        self.slice_writes = Counter(
            f"{PREFIX}_resourceslice_writes",
            "ResourceSlice creates and updates (a kubelet wipe adds a create)",
            ["how"],
            registry=self.registry,
        )
        self.status_writes = Counter(
            f"{PREFIX}_claim_status_writes",
            "Writes of claims' status.devices: written, or failed (retried every 2 s)",
            ["result"],
            registry=self.registry,
        )
        self.unhealthy = Gauge(
            f"{PREFIX}_unhealthy_cards", "Cards currently tainted unhealthy", registry=self.registry
        )
