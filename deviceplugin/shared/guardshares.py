"""Each share's use against its grant, per card, as metric series after every guard scan.

These are the per-container figures that a card-level exporter (dcgm-exporter) cannot give on a
shared card (``fracgpu top`` reads them). A share's series exist while it has processes on the
card and are removed when it has none, so their number stays bounded by the node's containers.
A card NVML does not sample per process has no compute-used series rather than a 0 that would
read as idle.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import suppress

from deviceplugin.shared.guardmetrics import GuardMetrics
from deviceplugin.shared.guardtypes import Usage

Labels = tuple[str, ...]  # namespace, pod, container, card UUID, model


def share_labels(usage: Usage) -> Labels:
    owner, card = usage.owner, usage.card
    return (owner.namespace, owner.pod, owner.container, card.uuid, card.product)


def share_totals(
    usage: list[Usage], busy: Mapping[int, Mapping[int, float]]
) -> tuple[dict[Labels, tuple[int, Usage]], dict[Labels, float]]:
    """Memory used (with the last entry seen) and compute used per series; a series of a card
    that is not sampled has no compute figure."""
    memory: dict[Labels, tuple[int, Usage]] = {}
    compute: dict[Labels, float] = {}
    for entry in usage:
        labels = share_labels(entry)
        held = memory.get(labels)
        memory[labels] = (entry.used + (held[0] if held else 0), entry)
        card_busy = busy.get(entry.card.index)
        if card_busy is not None:
            share = sum(card_busy.get(p.pid, 0.0) for p in entry.processes)
            compute[labels] = compute.get(labels, 0.0) + share
    return memory, compute


class ShareSeries:
    """The share series of the last scan, set from each new one."""

    def __init__(self, metrics: GuardMetrics) -> None:
        self.metrics = metrics
        self._exported: set[Labels] = set()  # share series set at the last scan

    def export(
        self,
        usage: list[Usage],
        busy: Mapping[int, Mapping[int, float]],
        ceilings: Mapping[str, int] | None = None,
    ) -> None:
        """Each share's use and grant per card; series of shares no longer seen are removed."""
        now, compute = share_totals(usage, busy)
        metrics = self.metrics
        for labels, (used, entry) in now.items():
            metrics.share_memory_used.labels(*labels).set(used)
            if labels in compute:
                metrics.share_compute_used.labels(*labels).set(min(100.0, compute[labels]))
            else:
                with suppress(KeyError):
                    metrics.share_compute_used.remove(*labels)
            metrics.share_memory_granted.labels(*labels).set(entry.owner.allowed(entry.card.uuid))
            metrics.share_compute_granted.labels(*labels).set(entry.owner.limits.compute_percent)
            ceiling = (ceilings or {}).get(entry.owner.grant)
            if ceiling is not None:
                metrics.share_compute_ceiling.labels(*labels).set(ceiling)
            else:
                with suppress(KeyError):
                    metrics.share_compute_ceiling.remove(*labels)
        for labels in self._exported - now.keys():
            self._remove(labels)
        self._exported = set(now)

    def _remove(self, labels: Labels) -> None:
        metrics = self.metrics
        for gauge in (
            metrics.share_memory_used,
            metrics.share_memory_granted,
            metrics.share_compute_used,
            metrics.share_compute_granted,
            metrics.share_compute_ceiling,
        ):
            with suppress(KeyError):
                gauge.remove(*labels)


__all__ = ["ShareSeries", "share_labels", "share_totals"]
