"""deviceplugin/shared/guardshares.py: each share's use against its grant as metric series, set
from every scan and removed once the share has no process on the card."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry

from core.contract import Limits
from core.units import MIB
from deviceplugin.shared.guardmetrics import GuardMetrics
from deviceplugin.shared.guardshares import ShareSeries, share_labels, share_totals
from deviceplugin.shared.guardtypes import ContainerRef, Owner, Process, Usage
from deviceplugin.shared.inventory import Card

PREFIX = "fracgpu_device_plugin"
CARDS = [Card(i, f"GPU-{i}", "NVIDIA L4", 23034, i, None) for i in range(2)]


def owner(container: str, grant: str = "") -> Owner:
    limits = Limits(("GPU-0",), 1024 * MIB, 30)
    return Owner("ns", "pod", container, "uid", f"cid-{container}", limits, grant)


def usage(container: str, card: int, *pids: int, grant: str = "") -> Usage:
    ref = ContainerRef("uid", f"cid-{container}")
    processes = tuple(Process(pid, 100 * MIB, 1, ref) for pid in pids)
    return Usage(owner(container, grant), CARDS[card], processes)


def labels(container: str, card: int) -> tuple[str, ...]:
    return ("ns", "pod", container, CARDS[card].uuid, CARDS[card].product)


@pytest.mark.parametrize(
    ("entries", "busy", "memory", "compute"),
    [
        pytest.param([], {}, {}, {}, id="nothing"),
        pytest.param(
            [usage("a", 0, 1, 2)],
            {0: {1: 20.0, 2: 5.0, 9: 50.0}},
            {labels("a", 0): 200 * MIB},
            {labels("a", 0): 25.0},
            id="its-processes-together",
        ),
        pytest.param(
            [usage("a", 0, 1)],
            {},
            {labels("a", 0): 100 * MIB},
            {},
            id="card-not-sampled-no-compute",
        ),
        pytest.param(
            [usage("a", 0, 1), usage("a", 1, 2)],
            {0: {}, 1: {2: 10.0}},
            {labels("a", 0): 100 * MIB, labels("a", 1): 100 * MIB},
            {labels("a", 0): 0.0, labels("a", 1): 10.0},
            id="per-card",
        ),
        pytest.param(
            # two grants of one container on one card (device plugin and claim): one series
            [usage("a", 0, 1), usage("a", 0, 2, grant="claim")],
            {0: {1: 10.0, 2: 10.0}},
            {labels("a", 0): 200 * MIB},
            {labels("a", 0): 20.0},
            id="one-series-per-container-and-card",
        ),
    ],
)
def test_share_totals(
    entries: list[Usage],
    busy: dict[int, dict[int, float]],
    memory: dict[tuple[str, ...], int],
    compute: dict[tuple[str, ...], float],
) -> None:
    used, busy_of = share_totals(entries, busy)
    assert {k: v[0] for k, v in used.items()} == memory
    assert busy_of == compute


def test_share_labels() -> None:
    assert share_labels(usage("a", 1, 1)) == ("ns", "pod", "a", "GPU-1", "NVIDIA L4")


@dataclass(frozen=True)
class Scan:
    usage: list[Usage]
    busy: dict[int, dict[int, float]] = field(default_factory=dict)
    ceilings: dict[str, int] | None = None


def series(metrics: GuardMetrics) -> dict[tuple[str, str], float]:
    """(family, container) -> value of every share series exported now."""
    return {
        (s.name.removeprefix(f"{PREFIX}_share_"), s.labels["container"]): s.value
        for family in metrics.registry.collect()
        for s in family.samples
        if s.name.startswith(f"{PREFIX}_share_")
    }


GRANTED = {"memory_granted_bytes": 1024 * MIB, "compute_granted_percent": 30}


@pytest.mark.parametrize(
    ("scans", "expected"),
    [
        pytest.param([], {}, id="never-scanned"),
        pytest.param(
            [Scan([usage("a", 0, 1)])],
            {"memory_used_bytes": 100 * MIB, **GRANTED},
            id="memory-and-grant-no-compute-unsampled",
        ),
        pytest.param(
            [Scan([usage("a", 0, 1)], {0: {1: 70.0}})],
            {"memory_used_bytes": 100 * MIB, "compute_used_percent": 70, **GRANTED},
            id="compute-used",
        ),
        pytest.param(
            [Scan([usage("a", 0, 1, 2)], {0: {1: 70.0, 2: 60.0}})],
            {"memory_used_bytes": 200 * MIB, "compute_used_percent": 100, **GRANTED},
            id="compute-never-over-the-card",
        ),
        pytest.param(
            [Scan([usage("a", 0, 1, grant="g")], {0: {}}, {"g": 55})],
            {
                "memory_used_bytes": 100 * MIB,
                "compute_used_percent": 0,
                "compute_ceiling_percent": 55,
                **GRANTED,
            },
            id="ceiling-of-a-metered-share",
        ),
        pytest.param(
            [Scan([usage("a", 0, 1, grant="g")], {0: {}}, {"g": 55}), Scan([usage("a", 0, 1)])],
            {"memory_used_bytes": 100 * MIB, **GRANTED},
            id="ceiling-and-compute-removed-when-gone",
        ),
        pytest.param(
            [Scan([usage("a", 0, 1)], {0: {1: 5.0}}), Scan([])],
            {},
            id="all-removed-once-the-share-leaves-the-card",
        ),
    ],
)
def test_export(scans: list[Scan], expected: dict[str, float]) -> None:
    metrics = GuardMetrics(CollectorRegistry(), PREFIX)
    shares = ShareSeries(metrics)
    for scan in scans:
        shares.export(scan.usage, scan.busy, scan.ceilings)
    assert series(metrics) == {(name, "a"): value for name, value in expected.items()}
