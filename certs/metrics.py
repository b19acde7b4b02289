"""Prometheus metrics of the certificates: what an alert on an expiring certificate reads."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from certs.material import ServingState, fingerprint


class CertsMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.not_after = Gauge(
            "fracgpu_certs_not_after_timestamp_seconds",
            "Expiry (Unix time) of the certificate being served and of each trusted CA; "
            "alert when it comes closer than the renewal point.",
            ["certificate", "fingerprint"],
            registry=registry,
        )
        self.reloads = Counter(
            "fracgpu_certs_reloads",
            "Times a new serving certificate was loaded into the running server.",
            registry=registry,
        )
        self.rotations = Counter(
            "fracgpu_certs_rotations",
            "Times this process wrote renewed certificates to the store.",
            registry=registry,
        )
        self.conflicts = Counter(
            "fracgpu_certs_store_conflicts",
            "Writes to the store lost to another writer (the winner's certificates are used).",
            registry=registry,
        )
        self.injections = Counter(
            "fracgpu_certs_cabundle_injections",
            "caBundle updates written into webhook configurations.",
            ["kind", "name"],
            registry=registry,
        )
        self.errors = Counter(
            "fracgpu_certs_errors",
            "Failures while refreshing, rotating or injecting certificates (retried).",
            ["operation"],
            registry=registry,
        )

    def observe(self, state: ServingState) -> None:
        self.not_after.clear()
        self.not_after.labels("serving", fingerprint(state.leaf)).set(
            state.leaf.not_valid_after_utc.timestamp()
        )
        for ca in state.trusted:
            self.not_after.labels("ca", fingerprint(ca)).set(ca.not_valid_after_utc.timestamp())
