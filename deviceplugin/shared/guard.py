"""The node guard: the hard memory boundary outside the container.

The hook inside a container counts what the program allocates through the CUDA driver API; what
it cannot see (raw ioctls on the device nodes, a scribbled accounting region) still shows up in
the driver's own per-process accounting. The guard's thread reads that accounting from NVML every
``interval_s``, attributes each process to its container, and acts when a container holds more
of a card than it was granted: it reports first (a log line, the metrics, and a Kubernetes Event
when a reporter for one is configured) and, after ``grace_s`` of continuous excess, kills the
container's processes on that card, largest first, until the rest fits.

This module only runs the passes; each concept lives in its own module, and this one imports
them all, none of them this one:

- guardtypes.py: what the pieces hand each other (a container, its owner, one scan's reading);
- guardproc.py: a pid's container and start time, from the node's /proc;
- guardowners.py: attribution, from a container to its fracgpu container and grant;
- guardscan.py: the scan, each card's processes from NVML, grouped by grant;
- guardkill.py: the enforcement, excess episodes, the grace, and the verified kill;
- guardreport.py, guardmetrics.py: the findings to logs, metrics and Events;
- guardevents.py: the Kubernetes Event sink, which the agent hands in as ``reporter``;
- guardshares.py: each share's use against its grant, as metric series;
- sharing.py: after each scan, each throttled share's usage file for its hook.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from core.units import MIB
from deviceplugin.shared.guardkill import Enforcer
from deviceplugin.shared.guardmetrics import GuardMetrics
from deviceplugin.shared.guardowners import LimitsDir, ListContainers, Owners, grant_from
from deviceplugin.shared.guardproc import ProcReader
from deviceplugin.shared.guardreport import GuardReport, Reporter
from deviceplugin.shared.guardscan import Scanner
from deviceplugin.shared.guardshares import ShareSeries
from deviceplugin.shared.guardtypes import Observation, Usage
from deviceplugin.shared.inventory import Card
from deviceplugin.shared.settings import GuardSettings
from deviceplugin.shared.sharing import PolicyOf, ShareMeter

log = logging.getLogger(__name__)


class Guard:
    """Every ``interval_s``, one pass: scan the cards, meter the shares, export their series,
    and act on each excess. A pass that fails is logged and the next one runs: a bug in one
    must not end the boundary for good."""

    def __init__(
        self,
        cards: Iterable[Card],
        owners: Owners,
        proc: ProcReader,
        metrics: GuardMetrics,
        *,
        interval_s: float = 0.5,
        grace_s: float = 1.0,
        kill: bool = True,
        process_overhead_mib: int = 512,
        reporter: Reporter | None = None,
        meter: ShareMeter | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cards = {c.index: c for c in cards}
        self.owners = owners
        self.metrics = metrics
        self.meter = meter
        self.interval_s = interval_s
        self.report = GuardReport(metrics, reporter)
        self.scanner = Scanner(self.cards, owners, proc, self.report)
        self.enforcer = Enforcer(
            self.cards,
            proc,
            self.report,
            grace_s=grace_s,
            kill=kill,
            overhead=process_overhead_mib * MIB,
            clock=clock,
        )
        self.shares = ShareSeries(metrics)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # The enforcement's settings, on the guard where its callers set them (the benchmark
    # drops the grace of a running guard).
    @property
    def grace_s(self) -> float:
        return self.enforcer.grace_s

    @grace_s.setter
    def grace_s(self, value: float) -> None:
        self.enforcer.grace_s = value

    @property
    def kill(self) -> bool:
        return self.enforcer.kill

    @kill.setter
    def kill(self, value: bool) -> None:
        self.enforcer.kill = value

    # ---- the thread --------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="guard", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                with self.metrics.guard_scan_seconds.time():
                    self.scan_once()
            except Exception:  # a bug here must not end the boundary for good
                log.exception("guard scan failed")

    # ---- one pass (public for tests and the benchmark) ---------------------------------

    def scan_once(self) -> Observation:
        observation = self.observe()
        self.act(observation)
        self.owners.forget_idle()
        return observation

    def observe(self) -> Observation:
        observation = self.scanner.observe()
        given: dict[str, int] = {}
        if self.meter is not None:
            written = self.meter.written
            given = self.meter.update(observation.usage, observation.busy)
            self.metrics.usage_files_written.inc(self.meter.written - written)
        self.shares.export(observation.usage, observation.busy, given)
        return observation

    def allowed(self, usage: Usage) -> int:
        """The grant plus each process's CUDA context, which NVML counts and the hook does not."""
        return self.enforcer.allowed(usage)

    def act(self, observation: Observation) -> None:
        self.enforcer.act(observation)


def build_guard(
    settings: GuardSettings,
    *,
    cards: Iterable[Card],
    list_containers: ListContainers,
    limits_dir: LimitsDir,
    metrics: GuardMetrics,
    reporter: Reporter | None,
    policy_of: PolicyOf | None = None,
) -> Guard:
    """The guard as either agent runs it: ``list_containers`` and ``limits_dir`` are the agent's
    view of who holds what and where its grants live."""
    owners = Owners(settings.container_logs, list_containers, grant_from(limits_dir))
    return Guard(
        cards,
        owners,
        ProcReader(settings.proc_root),
        metrics,
        interval_s=settings.interval_s,
        grace_s=settings.grace_s,
        kill=settings.kill,
        process_overhead_mib=settings.process_overhead_mib,
        reporter=reporter,
        meter=ShareMeter(policy_of),
    )


__all__ = ["Guard", "build_guard"]
