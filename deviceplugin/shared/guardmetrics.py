"""The node guard's metrics: the families, their names and help, under the prefix of the agent
that runs the guard (each agent registers them in its own registry).

What sets them lives with what it measures: guardreport.py (findings, kills, card reads),
guardshares.py (the shares' series), guard.py (the scan's time, the usage files written).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class GuardMetrics:
    """The guard's metrics, under the prefix of the agent that runs it (its caller's registry)."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        self.registry = registry
        self._findings(registry, prefix)
        self._shares(registry, prefix)
        self.guard_scan_seconds = Histogram(
            f"{prefix}_guard_scan_seconds",
            "Time of one guard scan over every card",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
            registry=registry,
        )

    def _findings(self, registry: CollectorRegistry, prefix: str) -> None:
        """What the guard found on each card and did about it."""
        self.guard_excess = Counter(
            f"{prefix}_guard_excess",
            "Times a grant was found holding more of a card than it was given",
            ["card"],
            registry=registry,
        )
        self.guard_containers_over = Gauge(
            f"{prefix}_guard_containers_over_grant",
            "Grants (containers; claims in DRA mode) over their share of the card at the last scan",
            ["card"],
            registry=registry,
        )
        self.guard_kills = Counter(
            f"{prefix}_guard_kills",
            "Processes the guard killed for their grant's excess",
            ["card"],
            registry=registry,
        )
        self.guard_kills_skipped = Counter(
            f"{prefix}_guard_kills_skipped",
            "Kills not made, by reason (pid reused, gone, left the container, not permitted)",
            ["reason"],
            registry=registry,
        )
        self.guard_foreign_processes = Gauge(
            f"{prefix}_guard_foreign_processes",
            "Processes on the card that belong to no fracgpu container (never acted on)",
            ["card"],
            registry=registry,
        )
        self.guard_unmeasured_processes = Gauge(
            f"{prefix}_guard_unmeasured_processes",
            "Processes on the card for which NVML gives no memory figure",
            ["card"],
            registry=registry,
        )
        self.guard_nvml_errors = Counter(
            f"{prefix}_guard_nvml_errors",
            "Process-list reads NVML failed (no action on the card that pass)",
            ["card"],
            registry=registry,
        )

    def _shares(self, registry: CollectorRegistry, prefix: str) -> None:
        """Each share's use against its grant, per card (guardshares.py)."""
        # Each share's use against its grant, per card: the per-container figures that a
        # card-level exporter (dcgm-exporter) cannot give on a shared card. One series per
        # grant and card while the grant has processes on the card (bounded by the node's
        # containers), removed when it has none.
        share = ["namespace", "pod", "container", "card_uuid", "model"]
        self.share_memory_used = Gauge(
            f"{prefix}_share_memory_used_bytes",
            "Card memory the share's processes hold, as NVML counts it (CUDA contexts included)",
            share,
            registry=registry,
        )
        self.share_memory_granted = Gauge(
            f"{prefix}_share_memory_granted_bytes",
            "Card memory the share was granted (its limits file)",
            share,
            registry=registry,
        )
        self.share_compute_used = Gauge(
            f"{prefix}_share_compute_used_percent",
            "Percent of the card's SMs the share's processes kept busy since the previous scan "
            "(NVML's per-process utilisation samples; absent where the card does not sample)",
            share,
            registry=registry,
        )
        self.share_compute_granted = Gauge(
            f"{prefix}_share_compute_granted_percent",
            "Percent of the card's compute the share was granted (100: unthrottled)",
            share,
            registry=registry,
        )
        self.share_compute_ceiling = Gauge(
            f"{prefix}_share_compute_ceiling_percent",
            "Percent of the card's compute the share may use now: its grant, or more while "
            "idle compute is lent to it (the usage file its hook reads)",
            share,
            registry=registry,
        )
        self.usage_files_written = Counter(
            f"{prefix}_usage_files_written",
            "Usage files written for the shares' hooks (each share's own use and its ceiling)",
            registry=registry,
        )


__all__ = ["GuardMetrics"]
