"""What the node guard says of its findings: a log line, its metrics, and a Kubernetes Event when
a reporter for one is configured (guardevents.py).

Every finding goes through here, so what an operator reads for one (its message, its fields,
its counter) is decided in one place, and the scan and the enforcement only state what
happened. A card NVML cannot read is logged once per error, not once per scan.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

from deviceplugin.shared.guardmetrics import GuardMetrics
from deviceplugin.shared.guardtypes import Owner, Process, Usage
from deviceplugin.shared.inventory import Card

# The guard's lines keep one logger, whichever of its modules writes them: operators and tests
# select the guard's log by this name.
log = logging.getLogger("deviceplugin.shared.guard")


class Reporter(Protocol):
    """Where the guard's findings go besides its log and metrics (a Kubernetes Event sink)."""

    def excess(self, owner: Owner, card: Card, used: int, allowed: int, grace_s: float) -> None: ...

    def killed(self, owner: Owner, card: Card, pid: int, used: int, allowed: int) -> None: ...


class GuardReport:
    """The guard's findings, each to its log line, its metrics and the Event sink."""

    def __init__(self, metrics: GuardMetrics, reporter: Reporter | None = None) -> None:
        self.metrics = metrics
        self.reporter = reporter
        self._failing: dict[int, str] = {}  # card -> the NVML error already logged

    # ---- the scan ----------------------------------------------------------------------

    def card_unreadable(self, card: Card, exc: Exception) -> None:
        self.metrics.guard_nvml_errors.labels(str(card.index)).inc()
        if self._failing.get(card.index) != str(exc):
            self._failing[card.index] = str(exc)
            log.warning(
                "guard cannot read the card's processes from NVML; no action on this card "
                "until it can",
                extra={"card": card.index, "error": str(exc)},
            )

    def card_readable(self, card: Card) -> None:
        if self._failing.pop(card.index, None) is not None:
            log.info("guard reads the card's processes again", extra={"card": card.index})

    def card_counts(self, card: Card, *, foreign: int, unmeasured: int) -> None:
        """The card's processes the guard does not act on, at the last read."""
        self.metrics.guard_foreign_processes.labels(str(card.index)).set(foreign)
        self.metrics.guard_unmeasured_processes.labels(str(card.index)).set(unmeasured)

    # ---- excess ------------------------------------------------------------------------

    def excess(self, usage: Usage, allowed: int, *, grace_s: float, kill: bool) -> None:
        card = usage.card
        self.metrics.guard_excess.labels(str(card.index)).inc()
        log.warning(
            "container holds more card memory than its grant",
            extra={
                "container": usage.owner.name,
                "pod_uid": usage.owner.pod_uid,
                "card": card.index,
                "used_bytes": usage.used,
                "allowed_bytes": allowed,
                "pids": [p.pid for p in usage.processes],
                "kill_after_s": grace_s if kill else None,
            },
        )
        if self.reporter is not None:
            self.reporter.excess(usage.owner, card, usage.used, allowed, grace_s)

    def within(self, grant: str, card: int) -> None:
        log.info("grant is back within its share", extra={"grant": grant, "card": card})

    def over(self, counts: Mapping[int, int]) -> None:
        """Grants over their share, per card, after a scan."""
        for card, count in counts.items():
            self.metrics.guard_containers_over.labels(str(card)).set(count)

    # ---- kills -------------------------------------------------------------------------

    def pid_reused(self, usage: Usage, pid: int) -> None:
        self.metrics.guard_kills_skipped.labels("pid reused").inc()
        log.warning(
            "guard saw a pid reused during an excess; not killing it this pass",
            extra={"pid": pid, "container": usage.owner.name},
        )

    def not_killed(self, usage: Usage, pid: int, why: str) -> None:
        self.metrics.guard_kills_skipped.labels(why).inc()
        log.info(
            "guard did not kill", extra={"pid": pid, "container": usage.owner.name, "why": why}
        )

    def gone(self) -> None:
        """A process to kill ended by itself first."""
        self.metrics.guard_kills_skipped.labels("gone").inc()

    def killed(self, usage: Usage, process: Process, allowed: int) -> None:
        self.metrics.guard_kills.labels(str(usage.card.index)).inc()
        log.warning(
            "guard killed a process over its container's grant",
            extra={
                "container": usage.owner.name,
                "pod_uid": usage.owner.pod_uid,
                "card": usage.card.index,
                "pid": process.pid,
                "used_bytes": process.used,
                "container_used_bytes": usage.used,
                "allowed_bytes": allowed,
            },
        )
        if self.reporter is not None:
            self.reporter.killed(usage.owner, usage.card, process.pid, process.used, allowed)


__all__ = ["GuardReport", "Reporter"]
