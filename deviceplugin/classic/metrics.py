"""Prometheus metrics of the device plugin, on the plugin's own registry."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from deviceplugin.classic.ledger import CardUsage
from deviceplugin.shared.services import NodeMetrics

PREFIX = "fracgpu_device_plugin"


class _CardCollector(Collector):
    """Per-card gauges read from the allocator at scrape time (never stale, never duplicated)."""

    def __init__(self, usage: Callable[[], list[CardUsage]]) -> None:
        self._usage = usage

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["card", "uuid"]
        core = GaugeMetricFamily(
            f"{PREFIX}_card_core_allocated", "Hundredths of the card allocated", labels=labels
        )
        memory = GaugeMetricFamily(
            f"{PREFIX}_card_memory_blocks_allocated", "Memory blocks allocated", labels=labels
        )
        blocks = GaugeMetricFamily(
            f"{PREFIX}_card_memory_blocks", "Memory blocks the card advertises", labels=labels
        )
        healthy = GaugeMetricFamily(
            f"{PREFIX}_card_healthy", "1 when the card is Healthy", labels=labels
        )
        for usage in self._usage():
            values = [str(usage.card.index), usage.card.uuid]
            core.add_metric(values, usage.core_used)
            memory.add_metric(values, usage.memory_used)
            blocks.add_metric(values, usage.blocks)
            healthy.add_metric(values, 1 if usage.healthy else 0)
        yield from (core, memory, blocks, healthy)


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.allocations = Counter(
            f"{PREFIX}_allocations",
            "Allocate container requests served",
            ["resource"],
            registry=self.registry,
        )
        self.waits = Counter(
            f"{PREFIX}_prestart_waits",
            "PreStartContainer calls answered 'waiting for a card' (admitted on capacity that "
            "ended pods left spread over cards; kubelet retries)",
            registry=self.registry,
        )
        self.failures = Counter(
            f"{PREFIX}_failures",
            "RPCs that returned an error to kubelet",
            ["resource", "rpc"],
            registry=self.registry,
        )
        self.registered = Gauge(
            f"{PREFIX}_registered",
            "1 while the resource is registered with kubelet",
            ["resource"],
            registry=self.registry,
        )
        self.registrations = Counter(
            f"{PREFIX}_registrations",
            "Successful Register calls (a kubelet restart adds one per resource)",
            ["resource"],
            registry=self.registry,
        )
        self.rpc_seconds = Histogram(
            f"{PREFIX}_rpc_seconds",
            "Time to serve a kubelet RPC",
            ["rpc"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5),
            registry=self.registry,
        )
        self.reconcile_seconds = Histogram(
            f"{PREFIX}_reconcile_seconds",
            "Time of one reconciliation pass against kubelet's PodResources",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
            registry=self.registry,
        )

        # health and the node guard (shared/services.py), under this agent's prefix
        self.node = NodeMetrics(registry, PREFIX)

    def watch_cards(self, usage: Callable[[], list[CardUsage]]) -> None:
        self.registry.register(_CardCollector(usage))
