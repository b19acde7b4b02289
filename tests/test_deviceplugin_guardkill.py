"""deviceplugin/shared/guardkill.py: when a grant's excess is acted on and which processes go,
with the kill itself replaced by a table of outcomes (the verified kill of real processes:
test_deviceplugin_guard.py::test_kill_verified)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from core.contract import Limits
from core.units import MIB
from deviceplugin.shared.guardkill import Enforcer
from deviceplugin.shared.guardmetrics import GuardMetrics
from deviceplugin.shared.guardproc import ProcReader
from deviceplugin.shared.guardreport import GuardReport
from deviceplugin.shared.guardtypes import ContainerRef, Observation, Owner, Process, Usage
from deviceplugin.shared.inventory import Card

PREFIX = "fracgpu_device_plugin"
CARDS = [Card(i, f"GPU-{i}", "NVIDIA L4", 23034, i, None) for i in range(2)]
REF = ContainerRef("6f1c2a8e-1b2c-4d5e-8f90-0123456789ab", "0f" * 32)
ALICE = Owner("ns", "alice", "main", REF.pod_uid, REF.container_id,
              Limits(("GPU-0",), 1024 * MIB, 50), grant="/grants/alice")  # fmt: skip
GRACE_S = 1.0


@dataclass
class Kills:
    """The kill as a table: pid -> outcome (default "killed"); what was asked, in order."""

    outcomes: dict[int, str] = field(default_factory=dict)
    asked: list[int] = field(default_factory=list)

    def __call__(self, proc: ProcReader, pid: int, start: int, ref: ContainerRef) -> str:
        self.asked.append(pid)
        return self.outcomes.get(pid, "killed")


@dataclass
class Events:
    excess: list[tuple[str, int, int]] = field(default_factory=list)  # container, used, allowed
    killed: list[int] = field(default_factory=list)

    def excess_of(self, owner: Owner, card: Card, used: int, allowed: int, grace_s: float) -> None:
        self.excess.append((owner.name, used, allowed))

    def killed_of(self, owner: Owner, card: Card, pid: int, used: int, allowed: int) -> None:
        self.killed.append(pid)


class Recorder:
    def __init__(self, events: Events) -> None:
        self.excess = events.excess_of
        self.killed = events.killed_of


def usage(*mib: int, card: int = 0, starts: dict[int, int] | None = None) -> Usage:
    """ALICE's processes on ``card``: pid 1, 2, ... holding ``mib`` each."""
    processes = tuple(
        Process(pid, used * MIB, (starts or {}).get(pid, 100), REF)
        for pid, used in enumerate(mib, start=1)
    )
    return Usage(ALICE, CARDS[card], processes)


@dataclass(frozen=True)
class Pass:
    """One scan: ALICE's processes on card 0 (none: she holds nothing there), the cards NVML
    could not read, then the clock moves on by ``then_s``."""

    mib: tuple[int, ...] = ()
    starts: dict[int, int] = field(default_factory=dict)
    failed: frozenset[int] = frozenset()
    then_s: float = GRACE_S


@dataclass(frozen=True)
class Case:
    passes: tuple[Pass, ...]
    asked: list[int] = field(default_factory=list)  # kills attempted, in order
    killed: list[int] = field(default_factory=list)  # kills made (Events)
    excess: int = 0  # excess reports
    over_after: bool = False  # an excess still under way after the last pass
    kill: bool = True
    overhead_mib: int = 0
    outcomes: dict[int, str] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)


CASES = [
    pytest.param(Case((Pass((1024,)), Pass((1024,)))), id="exactly-the-grant"),
    pytest.param(Case((Pass((1500,)),), excess=1, over_after=True), id="reported-before-grace"),
    pytest.param(
        Case((Pass((1500,)), Pass((1500,))), asked=[1], killed=[1], excess=1, over_after=True),
        id="killed-after-grace",
    ),
    pytest.param(
        Case((Pass((1500,)), Pass((1500,))), excess=1, over_after=True, kill=False),
        id="report-only",
    ),
    pytest.param(
        Case((Pass((1500,)), Pass((500,))), excess=1),
        id="back-within-before-grace",
    ),
    pytest.param(
        Case(
            (Pass((300, 900, 200)), Pass((300, 900, 200))),
            asked=[2],
            killed=[2],
            excess=1,
            over_after=True,
        ),
        id="largest-first-until-the-rest-fits",
    ),
    pytest.param(
        Case(
            (Pass((600, 600, 600)), Pass((600, 600, 600))),
            asked=[1, 2],
            killed=[1, 2],
            excess=1,
            over_after=True,
        ),
        id="equal-sizes-by-pid",
    ),
    pytest.param(
        Case(
            (Pass((900, 700)), Pass((900, 700))),
            asked=[1],
            excess=1,
            over_after=True,
            outcomes={1: "left the container"},
            skipped={"left the container": 1},
        ),
        id="stops-at-one-it-cannot-kill",
    ),
    pytest.param(
        Case(
            (Pass((900, 800, 300)), Pass((900, 800, 300))),
            asked=[1, 2],
            killed=[2],
            excess=1,
            over_after=True,
            outcomes={1: "gone"},
            skipped={"gone": 1},
        ),
        id="one-gone-by-itself-counts-as-freed",
    ),
    pytest.param(
        Case(
            (Pass((1500,)), Pass((1500,), starts={1: 999})),
            excess=1,
            over_after=True,
            skipped={"pid reused": 1},
        ),
        id="pid-reused-not-killed-this-pass",
    ),
    pytest.param(
        Case(
            (Pass((1500,)), Pass((1500,), starts={1: 999}), Pass((1500,), starts={1: 999})),
            asked=[1],
            killed=[1],
            excess=1,
            over_after=True,
            skipped={"pid reused": 1},
        ),
        id="pid-reused-settles-next-pass",
    ),
    pytest.param(
        Case((Pass((1500,)), Pass(failed=frozenset({0}))), excess=1, over_after=True),
        id="a-card-not-read-keeps-the-excess",
    ),
    pytest.param(
        Case((Pass((1500,)), Pass(failed=frozenset({1}))), excess=1),
        id="another-card-not-read-ends-it",
    ),
    pytest.param(
        Case((Pass((1400, 100)), Pass((1400, 100))), overhead_mib=256),
        id="context-allowance-per-process",
    ),
    pytest.param(
        Case(
            # without 1400 and its context, 1300 is over 1024 + one context (not two)
            (Pass((1400, 1300)), Pass((1400, 1300))),
            asked=[1, 2],
            killed=[1, 2],
            excess=1,
            over_after=True,
            overhead_mib=256,
        ),
        id="a-killed-process-takes-its-allowance-along",
    ),
]


@pytest.mark.parametrize("case", CASES)
def test_enforcer(case: Case) -> None:
    clock = [1000.0]
    events, kills = Events(), Kills(dict(case.outcomes))
    metrics = GuardMetrics(CollectorRegistry(), PREFIX)
    enforcer = Enforcer(
        [c.index for c in CARDS],
        ProcReader(Path("/nonexistent")),
        GuardReport(metrics, Recorder(events)),
        grace_s=GRACE_S,
        kill=case.kill,
        overhead=case.overhead_mib * MIB,
        clock=lambda: clock[0],
        kill_process=kills,
    )
    for scan in case.passes:
        observed = [usage(*scan.mib, starts=scan.starts)] if scan.mib else []
        enforcer.act(Observation(usage=observed, failed=set(scan.failed)))
        clock[0] += scan.then_s
    assert kills.asked == case.asked
    assert events.killed == case.killed
    assert len(events.excess) == case.excess
    assert enforcer.over == ({("/grants/alice", 0)} if case.over_after else set())
    over = metrics.registry.get_sample_value(f"{PREFIX}_guard_containers_over_grant", {"card": "0"})
    assert over == (1 if case.over_after else 0)
    for reason, count in case.skipped.items():
        skipped = metrics.registry.get_sample_value(
            f"{PREFIX}_guard_kills_skipped_total", {"reason": reason}
        )
        assert skipped == count


@pytest.mark.parametrize(
    ("mib", "overhead_mib", "allowed_mib"),
    [
        pytest.param((100,), 0, 1024, id="the-grant"),
        pytest.param((100, 100, 100), 256, 1024 + 3 * 256, id="plus-a-context-per-process"),
        pytest.param((100,), 512, 1024 + 512, id="default-overhead"),
    ],
)
def test_allowed(mib: tuple[int, ...], overhead_mib: int, allowed_mib: int) -> None:
    metrics = GuardMetrics(CollectorRegistry(), PREFIX)
    enforcer = Enforcer([0], ProcReader(Path("/")), GuardReport(metrics),
                        overhead=overhead_mib * MIB)  # fmt: skip
    assert enforcer.allowed(usage(*mib)) == allowed_mib * MIB
