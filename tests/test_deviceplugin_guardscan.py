"""deviceplugin/shared/guardscan.py: one reading of every card, attributed to grants, against
NVML replaced by a table (the real library against the fake driver:
test_deviceplugin_guard.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest
from prometheus_client import CollectorRegistry

from core.contract import Limits
from deviceplugin.shared.guardmetrics import GuardMetrics
from deviceplugin.shared.guardreport import GuardReport
from deviceplugin.shared.guardscan import ByGrant, Scanner, Utilisation
from deviceplugin.shared.guardtypes import ContainerRef, Observation, Owner, Process
from deviceplugin.shared.inventory import Card

CARDS = {i: Card(i, f"GPU-{i}", "NVIDIA L4", 23034, i, None) for i in range(2)}
PREFIX = "fracgpu_device_plugin"


def owner(name: str, grant: str = "") -> Owner:
    ref = ref_of(name)
    return Owner(
        "ns", name, "main", ref.pod_uid, ref.container_id, Limits(("GPU-0",), 1, 50), grant
    )


def ref_of(name: str) -> ContainerRef:
    return ContainerRef(f"uid-{name}", f"cid-{name}")


# ---- grouping ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("added", "expected"),
    [
        pytest.param([], [], id="nothing"),
        pytest.param(
            [("a", "", 0, 1), ("a", "", 0, 2)], [("ns/a/main", 0, (1, 2))], id="one-container"
        ),
        pytest.param(
            [("a", "", 0, 1), ("a", "", 1, 2)],
            [("ns/a/main", 0, (1,)), ("ns/a/main", 1, (2,))],
            id="per-card",
        ),
        pytest.param(
            [("a", "claim", 0, 1), ("b", "claim", 0, 2)],
            [("ns/a/main", 0, (1, 2))],
            id="one-grant-two-containers-first-named",
        ),
        pytest.param(
            [("b", "", 0, 2), ("a", "", 0, 1)],
            [("ns/b/main", 0, (2,)), ("ns/a/main", 0, (1,))],
            id="in-the-order-seen",
        ),
    ],
)
def test_by_grant(
    added: list[tuple[str, str, int, int]], expected: list[tuple[str, int, tuple[int, ...]]]
) -> None:
    grouped = ByGrant()
    for name, grant, card, pid in added:
        grouped.add(owner(name, grant), card, Process(pid, 100, 1, ref_of(name)))
    usage = grouped.usage(CARDS)
    assert [(u.owner.name, u.card.index, tuple(p.pid for p in u.processes)) for u in usage] == (
        expected
    )


# ---- NVML as a table -----------------------------------------------------------------------


@dataclass
class Nvml:
    """Per card UUID: its processes (pid -> MiB, -1: no figure) and utilisation samples."""

    processes: dict[str, dict[int, int]] = field(default_factory=dict)
    samples: dict[str, list[tuple[int, float, int]]] = field(default_factory=dict)  # pid, %, µs
    failing: set[str] = field(default_factory=set)
    unsampled: set[str] = field(default_factory=set)
    asked_since: list[int] = field(default_factory=list)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByUUID", self.handle)
        monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses", self.compute)
        monkeypatch.setattr(pynvml, "nvmlDeviceGetGraphicsRunningProcesses", lambda h: [])
        monkeypatch.setattr(pynvml, "nvmlDeviceGetProcessUtilization", self.utilisation)

    def handle(self, uuid: str) -> str:
        if uuid in self.failing:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        return uuid

    def compute(self, handle: str) -> list[Any]:
        return [
            SimpleNamespace(pid=pid, usedGpuMemory=None if mib < 0 else mib << 20)
            for pid, mib in self.processes.get(handle, {}).items()
        ]

    def utilisation(self, handle: str, since: int) -> list[Any]:
        self.asked_since.append(since)
        if handle in self.unsampled:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        rows = [s for s in self.samples.get(handle, []) if s[2] > since]
        if not rows:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return [SimpleNamespace(pid=p, smUtil=u, timeStamp=t) for p, u, t in rows]


@pytest.mark.parametrize(
    ("samples", "unsampled", "expected", "asked_since"),
    [
        pytest.param([], False, [{}, {}], [0, 0], id="no-process-used-the-sms"),
        pytest.param(
            [(7, 20.0, 10), (7, 40.0, 20), (8, 5.0, 20)],
            False,
            [{7: 30.0, 8: 5.0}, {}],
            [0, 20],
            id="mean-of-each-pids-samples-then-only-newer",
        ),
        pytest.param([(7, 20.0, 10)], True, [None, None], [0], id="not-sampled-asked-once"),
    ],
)
def test_utilisation(
    monkeypatch: pytest.MonkeyPatch,
    samples: list[tuple[int, float, int]],
    unsampled: bool,
    expected: list[dict[int, float] | None],
    asked_since: list[int],
) -> None:
    nvml = Nvml(samples={"GPU-0": samples}, unsampled={"GPU-0"} if unsampled else set())
    nvml.install(monkeypatch)
    utilisation = Utilisation()
    assert [utilisation.read(CARDS[0], "GPU-0") for _ in expected] == expected
    assert nvml.asked_since == asked_since


# ---- the scan ------------------------------------------------------------------------------


@dataclass
class Node:
    """/proc and the owners as a table: pid -> the container name it is in."""

    containers: dict[int, str] = field(default_factory=dict)
    owners: dict[str, Owner] = field(default_factory=dict)  # container name -> owner
    gone: set[int] = field(default_factory=set)  # pids with no start time (ended)

    def container(self, pid: int) -> ContainerRef | None:
        name = self.containers.get(pid)
        return None if name is None else ref_of(name)

    def start_time(self, pid: int) -> int | None:
        return None if pid in self.gone else pid * 10

    def resolve(self, ref: ContainerRef) -> Owner | None:
        return self.owners.get(ref.container_id.removeprefix("cid-"))


def scanner(node: Node) -> tuple[Scanner, GuardMetrics]:
    metrics = GuardMetrics(CollectorRegistry(), PREFIX)
    report = GuardReport(metrics)
    return Scanner(CARDS, node, node, report), metrics  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("pid", "node", "expected"),
    [
        pytest.param(5, Node({5: "a"}, {"a": owner("a")}), (owner("a"), 50), id="fracgpu"),
        pytest.param(5, Node(), None, id="in-no-container"),
        pytest.param(5, Node({5: "x"}), None, id="container-of-no-fracgpu-pod"),
        pytest.param(5, Node({5: "a"}, {"a": owner("a")}, {5}), None, id="ended-meanwhile"),
    ],
)
def test_attribute(pid: int, node: Node, expected: tuple[Owner, int] | None) -> None:
    attributed = scanner(node)[0].attribute(pid, 100)
    if expected is None:
        assert attributed is None
    else:
        assert attributed == (expected[0], Process(pid, 100, expected[1], ref_of("a")))


@dataclass(frozen=True)
class Scan:
    processes: dict[str, dict[int, int]]  # card UUID -> pid -> MiB
    usage: list[tuple[str, int, tuple[int, ...]]] = field(default_factory=list)
    foreign: dict[int, int] = field(default_factory=dict)
    unmeasured: dict[int, int] = field(default_factory=dict)
    failed: frozenset[int] = frozenset()
    failing: frozenset[str] = frozenset()


NODE = Node({1: "a", 2: "a", 3: "b", 4: "x"}, {"a": owner("a"), "b": owner("b", "claim")})


@pytest.mark.parametrize(
    "scan",
    [
        pytest.param(Scan({}, foreign={0: 0, 1: 0}, unmeasured={0: 0, 1: 0}), id="idle-node"),
        pytest.param(
            Scan(
                {"GPU-0": {1: 10, 2: 20}, "GPU-1": {3: 30}},
                usage=[("ns/a/main", 0, (1, 2)), ("ns/b/main", 1, (3,))],
                foreign={0: 0, 1: 0},
                unmeasured={0: 0, 1: 0},
            ),
            id="grouped-per-grant-and-card",
        ),
        pytest.param(
            Scan(
                {"GPU-0": {4: 10, 9: 10, 1: -1}},
                foreign={0: 2, 1: 0},
                unmeasured={0: 1, 1: 0},
            ),
            id="foreign-and-unmeasured-counted-not-grouped",
        ),
        pytest.param(
            Scan(
                {"GPU-0": {1: 10}, "GPU-1": {3: 30}},
                usage=[("ns/b/main", 1, (3,))],
                foreign={1: 0},
                unmeasured={1: 0},
                failed=frozenset({0}),
                failing=frozenset({"GPU-0"}),
            ),
            id="a-card-nvml-cannot-read",
        ),
    ],
)
def test_observe(monkeypatch: pytest.MonkeyPatch, scan: Scan) -> None:
    Nvml(processes=scan.processes, failing=set(scan.failing)).install(monkeypatch)
    observation = scanner(NODE)[0].observe()
    assert [
        (u.owner.name, u.card.index, tuple(p.pid for p in u.processes)) for u in observation.usage
    ] == scan.usage
    assert (observation.foreign, observation.unmeasured, observation.failed) == (
        scan.foreign,
        scan.unmeasured,
        set(scan.failed),
    )


def test_a_card_read_again_is_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    nvml = Nvml(failing={"GPU-0"})
    nvml.install(monkeypatch)
    scan, metrics = scanner(NODE)
    with caplog.at_level(logging.INFO, logger="deviceplugin.shared.guard"):
        observations: list[Observation] = [scan.observe(), scan.observe()]
        nvml.failing.clear()
        observations += [scan.observe(), scan.observe()]
    assert [o.failed for o in observations] == [{0}, {0}, set(), set()]
    messages = [r.getMessage() for r in caplog.records if "card's processes" in r.getMessage()]
    assert messages == [
        "guard cannot read the card's processes from NVML; no action on this card until it can",
        "guard reads the card's processes again",
    ]
    assert (
        metrics.registry.get_sample_value(f"{PREFIX}_guard_nvml_errors_total", {"card": "0"}) == 2
    )
