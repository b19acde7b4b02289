"""Prometheus metrics of the admission server, in the registry its caller passes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Admission is on the pod-create path: the buckets resolve the sub-millisecond range.
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class AdmissionMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.reviews = Counter(
            "fracgpu_admission_reviews",
            "Admission reviews answered, by endpoint, outcome and reason.",
            ["endpoint", "outcome", "reason"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "fracgpu_admission_duration_seconds",
            "Time to answer one admission review, body parsing included.",
            ["endpoint"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.bad_requests = Counter(
            "fracgpu_admission_bad_requests",
            "Requests answered with HTTP 400 (not an AdmissionReview).",
            ["endpoint"],
            registry=self.registry,
        )
        self.connections = Gauge(
            "fracgpu_admission_connections",
            "Open connections (TLS handshake done).",
            registry=self.registry,
        )
        self.connections_closed = Counter(
            "fracgpu_admission_connections_closed",
            "Connections the server closed to bound what clients hold, by reason: "
            "header-timeout, evicted (idle, to make room), refused (at the cap, all busy), "
            "unread-body (answered before a large body was read: the rest is not read).",
            ["reason"],
            registry=self.registry,
        )
        self.bodies_refused = Counter(
            "fracgpu_admission_bodies_refused",
            "Request bodies not reviewed, by reason: too-large (413), timeout (408), busy "
            "(503: the in-flight body budget stayed full), abandoned (the client went away).",
            ["endpoint", "reason"],
            registry=self.registry,
        )
        self.inflight_body_bytes = Gauge(
            "fracgpu_admission_inflight_body_bytes",
            "Bytes of request bodies being read or reviewed (by Content-Length).",
            registry=self.registry,
        )
