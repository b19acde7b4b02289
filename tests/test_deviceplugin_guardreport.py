"""deviceplugin/shared/guardreport.py and guardmetrics.py: each finding's log line, counter and
Event, and the metric families the agents export."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry

from core.contract import Limits
from core.units import MIB
from deviceplugin.shared.guardmetrics import GuardMetrics
from deviceplugin.shared.guardreport import GuardReport
from deviceplugin.shared.guardtypes import ContainerRef, Owner, Process, Usage
from deviceplugin.shared.inventory import Card

PREFIX = "fracgpu_device_plugin"
CARD = Card(1, "GPU-1", "NVIDIA L4", 23034, 1, None)
REF = ContainerRef("6f1c2a8e-1b2c-4d5e-8f90-0123456789ab", "0f" * 32)
OWNER = Owner("ns", "pod", "main", REF.pod_uid, REF.container_id, Limits(("GPU-1",), MIB, 50))
PROCESS = Process(7, 3 * MIB, 100, REF)
USAGE = Usage(OWNER, CARD, (PROCESS,))


@dataclass
class Sink:
    calls: list[tuple[str, int | float]] = field(default_factory=list)

    def excess(self, owner: Owner, card: Card, used: int, allowed: int, grace_s: float) -> None:
        self.calls.append(("excess", grace_s))

    def killed(self, owner: Owner, card: Card, pid: int, used: int, allowed: int) -> None:
        self.calls.append(("killed", pid))


@dataclass(frozen=True)
class Finding:
    say: Callable[[GuardReport], None]
    sample: tuple[str, dict[str, str], float] | None  # metric, labels, value after
    message: str | None  # the log line (None: none at WARNING or INFO)
    level: int = logging.WARNING
    fields: dict[str, object] = field(default_factory=dict)
    sink: list[tuple[str, int | float]] = field(default_factory=list)


FINDINGS = [
    pytest.param(
        Finding(
            lambda r: r.excess(USAGE, 2 * MIB, grace_s=1.5, kill=True),
            ("guard_excess_total", {"card": "1"}, 1),
            "container holds more card memory than its grant",
            fields={"container": "ns/pod/main", "used_bytes": 3 * MIB, "kill_after_s": 1.5},
            sink=[("excess", 1.5)],
        ),
        id="excess",
    ),
    pytest.param(
        Finding(
            lambda r: r.excess(USAGE, 2 * MIB, grace_s=1.5, kill=False),
            ("guard_excess_total", {"card": "1"}, 1),
            "container holds more card memory than its grant",
            fields={"kill_after_s": None, "pids": [7]},
            sink=[("excess", 1.5)],
        ),
        id="excess-report-only",
    ),
    pytest.param(
        Finding(
            lambda r: r.killed(USAGE, PROCESS, 2 * MIB),
            ("guard_kills_total", {"card": "1"}, 1),
            "guard killed a process over its container's grant",
            fields={"pid": 7, "container_used_bytes": 3 * MIB, "allowed_bytes": 2 * MIB},
            sink=[("killed", 7)],
        ),
        id="killed",
    ),
    pytest.param(
        Finding(
            lambda r: r.not_killed(USAGE, 7, "not permitted"),
            ("guard_kills_skipped_total", {"reason": "not permitted"}, 1),
            "guard did not kill",
            level=logging.INFO,
            fields={"why": "not permitted"},
        ),
        id="not-killed",
    ),
    pytest.param(
        Finding(
            lambda r: r.pid_reused(USAGE, 7),
            ("guard_kills_skipped_total", {"reason": "pid reused"}, 1),
            "guard saw a pid reused during an excess; not killing it this pass",
        ),
        id="pid-reused",
    ),
    pytest.param(
        Finding(lambda r: r.gone(), ("guard_kills_skipped_total", {"reason": "gone"}, 1), None),
        id="gone-by-itself-silent",
    ),
    pytest.param(
        Finding(
            lambda r: r.within("/grants/g", 1),
            None,
            "grant is back within its share",
            level=logging.INFO,
            fields={"grant": "/grants/g", "card": 1},
        ),
        id="back-within",
    ),
    pytest.param(
        Finding(
            lambda r: r.over({0: 0, 1: 2}),
            ("guard_containers_over_grant", {"card": "1"}, 2),
            None,
        ),
        id="over-per-card",
    ),
    pytest.param(
        Finding(
            lambda r: r.card_counts(CARD, foreign=3, unmeasured=1),
            ("guard_foreign_processes", {"card": "1"}, 3),
            None,
        ),
        id="card-counts",
    ),
    pytest.param(
        Finding(
            lambda r: r.card_unreadable(CARD, RuntimeError("Unknown Error")),
            ("guard_nvml_errors_total", {"card": "1"}, 1),
            "guard cannot read the card's processes from NVML; no action on this card until it can",
            fields={"error": "Unknown Error"},
        ),
        id="card-unreadable",
    ),
]


@pytest.mark.parametrize("finding", FINDINGS)
def test_finding(finding: Finding, caplog: pytest.LogCaptureFixture) -> None:
    metrics, sink = GuardMetrics(CollectorRegistry(), PREFIX), Sink()
    with caplog.at_level(logging.INFO, logger="deviceplugin.shared.guard"):
        finding.say(GuardReport(metrics, sink))
    if finding.sample is not None:
        name, labels, value = finding.sample
        assert metrics.registry.get_sample_value(f"{PREFIX}_{name}", labels) == value
    records = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert [r.getMessage() for r in records] == ([finding.message] if finding.message else [])
    for record in records:
        assert (record.name, record.levelno) == ("deviceplugin.shared.guard", finding.level)
        assert {k: getattr(record, k, None) for k in finding.fields} == finding.fields
    assert sink.calls == finding.sink


@pytest.mark.parametrize(
    ("errors", "logged"),
    [
        pytest.param(["a", "a", "a"], 1, id="same-error-once"),
        pytest.param(["a", "b", "b"], 2, id="each-new-error"),
        pytest.param(["a", None, "a"], 2, id="again-after-reading"),
    ],
)
def test_a_failing_card_is_logged_once_per_error(
    errors: list[str | None], logged: int, caplog: pytest.LogCaptureFixture
) -> None:
    report = GuardReport(GuardMetrics(CollectorRegistry(), PREFIX))
    with caplog.at_level(logging.WARNING, logger="deviceplugin.shared.guard"):
        for error in errors:
            if error is None:
                report.card_readable(CARD)
            else:
                report.card_unreadable(CARD, RuntimeError(error))
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == logged


def test_the_metric_families() -> None:
    """The names dashboards and ``fracgpu top`` read: a rename is a breaking change."""
    registry = CollectorRegistry()
    GuardMetrics(registry, PREFIX)
    assert sorted(family.name.removeprefix(f"{PREFIX}_") for family in registry.collect()) == [
        "guard_containers_over_grant",
        "guard_excess",
        "guard_foreign_processes",
        "guard_kills",
        "guard_kills_skipped",
        "guard_nvml_errors",
        "guard_scan_seconds",
        "guard_unmeasured_processes",
        "share_compute_ceiling_percent",
        "share_compute_granted_percent",
        "share_compute_used_percent",
        "share_memory_granted_bytes",
        "share_memory_used_bytes",
        "usage_files_written",
    ]
