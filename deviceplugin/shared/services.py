"""The services every node agent runs beside its kubelet API, started and stopped in one place:
the NVML health monitor, the node guard with its Events, and ``/metrics`` with ``/healthz``.

Each of them blocks (NVML's event wait, the guard's NVML and /proc scans, the stdlib HTTP
server), so each runs on its own thread in either agent. What differs between the agents is only
how results reach them, and that comes in as plain callables: the device plugin (threads) calls
its allocator directly and posts Events through its ``ApiLoop``; the DRA plugin (one event loop)
hands health changes to its loop with ``run_coroutine_threadsafe`` and posts Events with
``spawner_on``. ``stop`` blocks until every thread has ended; the DRA plugin calls it through
``asyncio.to_thread``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter

from deviceplugin.shared.apiloop import Spawn
from deviceplugin.shared.guard import Guard, build_guard
from deviceplugin.shared.guardevents import EventReporter
from deviceplugin.shared.guardmetrics import GuardMetrics
from deviceplugin.shared.guardowners import LimitsDir, ListContainers
from deviceplugin.shared.health import HealthCallback, HealthMonitor
from deviceplugin.shared.http import serve
from deviceplugin.shared.inventory import Card
from deviceplugin.shared.settings import NodeSettings
from deviceplugin.shared.sharing import PolicyOf

log = logging.getLogger(__name__)


class NodeMetrics:
    """The node services' metrics, under the prefix of the agent that runs them."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        self.health_events = Counter(
            f"{prefix}_health_events",
            "NVML health events seen, by card and reason",
            ["card", "reason"],
            registry=registry,
        )
        self.guard = GuardMetrics(registry, prefix)


@dataclass(frozen=True, slots=True)
class GuardSource:
    """What the guard learns from its agent: who holds what, where each grant is written, and
    each share's policy (None: every share is a hard cap)."""

    list_containers: ListContainers
    limits_dir: LimitsDir
    policy_of: PolicyOf | None = None


class NodeServices:
    """Health, guard, Events and HTTP for one agent; ``start`` then ``stop``, once each."""

    def __init__(
        self,
        settings: NodeSettings,
        cards: Sequence[Card],
        *,
        metrics: NodeMetrics,
        registry: CollectorRegistry,
        on_health: HealthCallback,
        registered: Callable[[], bool],
        spawn: Spawn | None,
    ) -> None:
        """``registered`` says whether kubelet has the agent registered (``/healthz``);
        ``spawn`` runs API calls for the guard's Events (None: no API server, no Events)."""
        self.settings = settings
        self.cards = tuple(cards)
        self.metrics = metrics
        self.registry = registry
        self._on_health = on_health
        self._registered = registered
        self._spawn = spawn
        self.health: HealthMonitor | None = None
        self.guard: Guard | None = None
        self.events: EventReporter | None = None
        self.http: ThreadingHTTPServer | None = None

    def start(self, guard: GuardSource | None) -> None:
        """Health first (a card that fails now is marked before anyone is placed on it), then
        the guard when ``--guard-interval`` is above 0 and the agent gave it a source, then
        ``/metrics`` and ``/healthz``."""
        settings = self.settings
        self.health = HealthMonitor(
            self.cards,
            self._on_health,
            ignored_xids=settings.ignored_xids,
            wait_ms=settings.health_wait_ms,
            probe_interval_s=settings.health_probe_interval_s,
            quiet_s=settings.health_quiet_s,
            error_backoff_s=settings.health_error_backoff_s,
            on_event=lambda card, reason: self.metrics.health_events.labels(
                str(card), reason
            ).inc(),
        )
        self.health.start()
        if guard is not None and settings.guard.interval_s > 0:
            self.guard = self._guard(guard)
            self.guard.start()
        if settings.metrics_port:
            self.http = serve(
                settings.metrics_address, settings.metrics_port, self.registry, self.healthz
            )

    def _guard(self, source: GuardSource) -> Guard:
        settings = self.settings
        if settings.node_name and self._spawn is not None:
            self.events = EventReporter(settings.node_name, self._spawn, kill=settings.guard.kill)
        return build_guard(
            settings.guard,
            cards=self.cards,
            list_containers=source.list_containers,
            limits_dir=source.limits_dir,
            metrics=self.metrics.guard,
            reporter=self.events,
            policy_of=source.policy_of,
        )

    def healthz(self) -> tuple[bool, str]:
        if not self._registered():
            return False, "not registered with kubelet"
        if self.health is None or not self.health.running:
            return False, "NVML health thread is not running"
        if self.guard is not None and not self.guard.running:
            return False, "node guard thread is not running"
        return True, "ok"

    def stop_http(self) -> None:
        """First at an agent's stop: a probe then sees no half-stopped agent."""
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
            self.http = None

    def stop(self) -> None:
        """Every thread these services started has ended when this returns."""
        self.stop_http()
        if self.health is not None:
            self.health.stop()
        if self.guard is not None:
            self.guard.stop()


__all__ = ["GuardSource", "NodeMetrics", "NodeServices"]
