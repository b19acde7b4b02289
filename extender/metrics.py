"""Prometheus metrics of the scheduler extender, in the registry serve passes.

The extender is on the scheduler's path for every GPU pod: filter runs inside the scheduling
cycle (one pod at a time), bind in the binding cycle. What an operator sizing or debugging it
needs: how long each verb takes, how often it answers an error (the pod is then retried), and
how many pods each ledger write books (a burst on one node should share writes)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Histogram

# Filter is in the scheduling cycle: the buckets resolve the sub-millisecond range.
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)


class ExtenderMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.duration = Histogram(
            "fracgpu_extender_duration_seconds",
            "Time to answer one extender call (filter, prioritize, bind), body parsing included.",
            ["verb"],
            buckets=_BUCKETS,
            registry=registry,
        )
        self.answers = Counter(
            "fracgpu_extender_answers",
            "Extender calls answered, by verb and outcome: ok, error (the scheduler retries "
            "the pod, with the reason on it), bad-request (not the scheduler's wire shape).",
            ["verb", "outcome"],
            registry=registry,
        )
        self.bind_stage = Histogram(
            "fracgpu_extender_bind_stage_seconds",
            "Time each stage of a successful bind took: read (the pod, unless the informer "
            "vouches for it), book (waiting for and making the ledger write), post (the "
            "Binding).",
            ["stage"],
            buckets=_BUCKETS,
            registry=registry,
        )
        self.ledger_writes = Histogram(
            "fracgpu_extender_ledger_write_seconds",
            "GPUNodeLedger writes (bookings and reclaims) and their duration, by outcome: "
            "written, conflict (another writer came first: read again and retry), error.",
            ["outcome"],
            buckets=_BUCKETS,
            registry=registry,
        )
        self.batch = Histogram(
            "fracgpu_extender_bookings_per_write",
            "Pods whose booking one GPUNodeLedger write carried (binds of one node share writes).",
            buckets=_BATCHES,
            registry=registry,
        )

    @contextmanager
    def timed(self, verb: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.duration.labels(verb).observe(time.perf_counter() - start)

    def ledger_written(self, outcome: str, seconds: float) -> None:
        self.ledger_writes.labels(outcome).observe(seconds)

    def staged(self, stage: str, seconds: float) -> None:
        self.bind_stage.labels(stage).observe(seconds)

    def answered(self, verb: str, outcome: str) -> None:
        self.answers.labels(verb, outcome).inc()
