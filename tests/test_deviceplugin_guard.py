"""The node guard against the fake NVML (per-process memory) and real processes it may kill."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pynvml
import pytest
from prometheus_client import CollectorRegistry

from core.contract import Limits
from deviceplugin.classic.allocation import container_dir_name
from deviceplugin.classic.config import Config
from deviceplugin.classic.plugin import DevicePlugin
from deviceplugin.classic.prestart import limits_for
from deviceplugin.shared import inventory
from deviceplugin.shared.guard import Guard
from deviceplugin.shared.guardkill import kill_verified
from deviceplugin.shared.guardmetrics import GuardMetrics
from deviceplugin.shared.guardowners import Grant, GrantError, Owners, grant_from
from deviceplugin.shared.guardproc import ProcReader, parse_cgroup
from deviceplugin.shared.guardscan import card_processes
from deviceplugin.shared.guardtypes import ContainerRef
from deviceplugin.shared.inventory import Card
from deviceplugin.shared.podresources import ContainerDevices, PodResourcesError
from deviceplugin.shared.settings import GuardSettings
from testkit.gpunode import cards as fake_cards
from testkit.gpunode import gpu_node
from testkit.kubelet import Container, Pod
from testkit.nodeproc import FakeContainer, NodeProc, container
from testkit.nvml import FakeNvml, build_cached

CONFIG = Config()
CORE, MEMORY = CONFIG.core_resource, CONFIG.memory_resource
UID = "6f1c2a8e-1b2c-4d5e-8f90-0123456789ab"
CID = "0f" * 32
GRACE_S = 1.0
PREFIX = "fracgpu_device_plugin"

# ---- from a cgroup file to a container ---------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
            f"{UID.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n",
            ContainerRef(UID, CID),
            id="systemd-containerd",
        ),
        pytest.param(
            f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/crio-{CID}.scope\n",
            ContainerRef(UID, CID),
            id="systemd-crio-guaranteed",
        ),
        pytest.param(
            f"0::/kubepods/besteffort/pod{UID}/{CID}\n", ContainerRef(UID, CID), id="cgroupfs"
        ),
        pytest.param(
            f"12:memory:/kubepods/burstable/pod{UID}/{CID}\n"
            f"11:pids:/kubepods/burstable/pod{UID}/{CID}\n",
            ContainerRef(UID, CID),
            id="cgroup-v1",
        ),
        pytest.param(
            f"0::/../../kubepods-besteffort-pod{UID.replace('-', '_')}.slice/docker-{CID}.scope\n",
            ContainerRef(UID, CID),
            id="seen-from-another-cgroup-namespace",
        ),
        pytest.param(
            f"0::/kubepods/burstable/pod{UID}/{CID}/inner/child\n",
            ContainerRef(UID, CID),
            id="below-the-container",
        ),
        pytest.param(
            f"0::/kubepods/pod{'a' * 32}/{CID}\n",
            ContainerRef("a" * 32, CID),
            id="static-pod-hash-uid",
        ),
        pytest.param("0::/system.slice/nvidia-persistenced.service\n", None, id="system-service"),
        pytest.param("0::/user.slice/user-1000.slice/session-3.scope\n", None, id="login-session"),
        pytest.param(
            f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice\n",
            None,
            id="pod-level-only",
        ),
        pytest.param(
            f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/"
            f"crio-conmon-{CID}.scope\n",
            None,
            id="crio-conmon",
        ),
        pytest.param("", None, id="empty"),
    ],
)
def test_parse_cgroup(text: str, expected: ContainerRef | None) -> None:
    assert parse_cgroup(text) == expected


# ---- fixtures ------------------------------------------------------------------------------


@pytest.fixture
def nvml(tmp_path: Path) -> Iterator[tuple[FakeNvml, list[Card]]]:
    fake = FakeNvml(tmp_path, fake_cards(2, 8192))
    os.environ.update(fake.env())
    inventory.load_nvml(build_cached())
    try:
        yield fake, inventory.discover()
    finally:
        inventory.shutdown_nvml()
        for key in fake.env():
            os.environ.pop(key, None)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[NodeProc]:
    procs = NodeProc(tmp_path / "node")
    try:
        yield procs
    finally:
        procs.close()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def holding(target: FakeContainer, card: int, blocks: int, core: int = 50) -> ContainerDevices:
    """``target`` as PodResources lists it: ``core`` and ``blocks`` of one card."""
    return ContainerDevices(
        target.namespace,
        target.pod,
        target.container,
        {
            CORE: frozenset(f"g{card}-c{n}" for n in range(core)),
            MEMORY: frozenset(f"g{card}-m{n}" for n in range(blocks)),
        },
    )


def by_ids(cards: list[Card]) -> Grant:
    """The grant of a container whose IDs ``holding`` named after its card (in the plugin the
    card comes from its limits file: ``test_the_grant_is_the_containers_limits_file``)."""
    by_index = {c.index: c for c in cards}

    def grant(container: ContainerDevices) -> tuple[str, Limits]:
        core, memory = container.ids(CORE), container.ids(MEMORY)
        card = int(next(iter(core or memory))[1 : next(iter(core or memory)).index("-")])
        return container.name, limits_for(
            container.name,
            len(core),
            len(memory),
            [card],
            by_index,
            core_resource=CORE,
            memory_resource=MEMORY,
        )

    return grant


def test_the_grant_is_the_containers_limits_file(tmp_path: Path) -> None:
    config = Config(host_root=tmp_path)
    plugin = DevicePlugin(
        config, [Card(i, f"GPU-{i}", "NVIDIA L4", 23034, i, None) for i in range(4)]
    )
    target = ContainerDevices("ns", "pod", "c", {CORE: frozenset({"g3-c1", "g0-c7"})})
    limits = Limits(("GPU-2",), 8 * 2**30, 30)
    grant = grant_from(plugin.grant_dir)
    with pytest.raises(GrantError, match="no limits file"):
        grant(target)
    directory = config.containers_dir / container_dir_name(["g0-c7", "g3-c1"]) / "limits"
    limits.write_atomic(directory)
    assert grant(target) == (str(directory), limits)
    with pytest.raises(GrantError, match="holds no"):
        grant(ContainerDevices("ns", "pod", "c", {MEMORY: frozenset({"g0-m1"})}))


@dataclass
class Setup:
    guard: Guard
    metrics: GuardMetrics
    clock: Clock
    listed: list[ContainerDevices]
    calls: list[int] = field(default_factory=list)


def make_guard(
    node: NodeProc,
    cards: list[Card],
    listed: list[ContainerDevices],
    *,
    kill: bool = True,
    overhead_mib: int = 0,
) -> Setup:
    clock = Clock()
    metrics = GuardMetrics(CollectorRegistry(), PREFIX)
    calls: list[int] = []

    def list_containers() -> list[ContainerDevices]:
        calls.append(1)
        return listed

    owners = Owners(node.logs, list_containers, by_ids(cards), clock=clock)
    guard = Guard(
        cards,
        owners,
        ProcReader(node.proc),
        metrics,
        grace_s=GRACE_S,
        kill=kill,
        process_overhead_mib=overhead_mib,
        clock=clock,
    )
    return Setup(guard, metrics, clock, listed, calls)


def alice_share(card: Card) -> dict[str, str]:
    """The labels of ALICE's share series on ``card``."""
    return {
        "namespace": ALICE.namespace,
        "pod": ALICE.pod,
        "container": ALICE.container,
        "card_uuid": card.uuid,
        "model": card.product,
    }


def sample(metrics: GuardMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(f"{PREFIX}_{name}", labels)
    return 0.0 if value is None else value


def killed(child: subprocess.Popen[bytes]) -> bool:
    try:
        return child.wait(timeout=2) == -signal.SIGKILL
    except subprocess.TimeoutExpired:
        return False


def alive(child: subprocess.Popen[bytes]) -> bool:
    return child.poll() is None


# ---- the decision, one case per row --------------------------------------------------------

ALICE = container("team-a", "train-0", "main")
BOB = container("team-b", "infer-0", "server")
STRANGER = container("team-c", "other-gpu", "main")  # a pod with no fracgpu resources


@dataclass(frozen=True)
class Proc:
    owner: str  # "alice" / "bob" (fracgpu), "stranger" (not fracgpu), "system" (no pod)
    card: int
    mib: int  # -1: NVML cannot tell
    graphics: bool = False
    also_compute: bool = False


@dataclass(frozen=True)
class Scenario:
    procs: tuple[Proc, ...]
    killed: frozenset[int] = frozenset()  # indexes into procs
    excess: int = 0  # guard_excess_total on card 0 and 1 together
    kill: bool = True
    foreign: tuple[int, int] = (0, 0)
    unmeasured: tuple[int, int] = (0, 0)
    overhead_mib: int = 0


# alice: 4 blocks (1 GiB) on card 0; bob: 8 blocks (2 GiB) on card 1
SCENARIOS = [
    pytest.param(Scenario((Proc("alice", 0, 1024),)), id="exactly-the-grant"),
    pytest.param(Scenario((Proc("alice", 0, 600), Proc("alice", 0, 400))), id="two-within-grant"),
    pytest.param(
        Scenario((Proc("alice", 0, 1500),), killed=frozenset({0}), excess=1),
        id="over-grant-killed-after-grace",
    ),
    pytest.param(
        Scenario(
            (Proc("alice", 0, 300), Proc("alice", 0, 900), Proc("alice", 0, 200)),
            killed=frozenset({1}),
            excess=1,
        ),
        id="largest-first-until-the-rest-fits",
    ),
    pytest.param(
        Scenario((Proc("alice", 0, 1500),), excess=1, kill=False), id="report-only-never-kills"
    ),
    pytest.param(
        Scenario((Proc("alice", 0, 1500), Proc("bob", 1, 2048)), killed=frozenset({0}), excess=1),
        id="only-the-container-over-its-grant",
    ),
    pytest.param(
        Scenario((Proc("alice", 1, 100),), killed=frozenset({0}), excess=1),
        id="card-it-was-not-given",
    ),
    pytest.param(
        Scenario((Proc("stranger", 0, 60000),), foreign=(1, 0)),
        id="container-of-no-fracgpu-pod-ignored",
    ),
    pytest.param(
        Scenario((Proc("system", 1, 60000),), foreign=(0, 1)), id="process-in-no-pod-ignored"
    ),
    pytest.param(
        Scenario((Proc("alice", 0, -1),), unmeasured=(1, 0)), id="nvml-gives-no-figure-ignored"
    ),
    pytest.param(
        Scenario((Proc("alice", 0, 900, graphics=True, also_compute=True),)),
        id="compute-and-graphics-counted-once",
    ),
    pytest.param(
        Scenario((Proc("alice", 0, 1400), Proc("alice", 0, 100)), overhead_mib=256),
        id="context-allowance-per-process",
    ),
]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_guard_decision(
    scenario: Scenario, nvml: tuple[FakeNvml, list[Card]], node: NodeProc
) -> None:
    fake, cards = nvml
    listed = [holding(ALICE, 0, 4), holding(BOB, 1, 8)]
    setup = make_guard(node, cards, listed, kill=scenario.kill, overhead_mib=scenario.overhead_mib)
    places = {"alice": ALICE, "bob": BOB, "stranger": STRANGER}
    children = []
    for proc in scenario.procs:
        child = node.spawn()
        children.append(child)
        if proc.owner == "system":
            node.place(child.pid, "0::/system.slice/cron.service\n")
        else:
            node.enter(child.pid, places[proc.owner])
        fake.process(proc.card, child.pid, proc.mib, graphics=proc.graphics)
        if proc.also_compute:
            fake.process(proc.card, child.pid, proc.mib)
    setup.guard.scan_once()
    assert [alive(c) for c in children] == [True] * len(children)  # nothing before the grace
    setup.clock.now += GRACE_S
    setup.guard.scan_once()
    gone = {i for i, child in enumerate(children) if i in scenario.killed and killed(child)}
    assert gone == scenario.killed
    assert {i for i, c in enumerate(children) if alive(c)} == set(range(len(children))) - gone
    excess = sum(sample(setup.metrics, "guard_excess_total", card=str(c)) for c in (0, 1))
    assert excess == scenario.excess
    kills = sum(sample(setup.metrics, "guard_kills_total", card=str(c)) for c in (0, 1))
    assert kills == len(scenario.killed)
    foreign = tuple(
        int(sample(setup.metrics, "guard_foreign_processes", card=str(c))) for c in (0, 1)
    )
    assert foreign == scenario.foreign
    unmeasured = tuple(
        int(sample(setup.metrics, "guard_unmeasured_processes", card=str(c))) for c in (0, 1)
    )
    assert unmeasured == scenario.unmeasured


def test_excess_is_reported_before_any_kill(
    nvml: tuple[FakeNvml, list[Card]], node: NodeProc, caplog: pytest.LogCaptureFixture
) -> None:
    fake, cards = nvml
    setup = make_guard(node, cards, [holding(ALICE, 0, 4)])
    child = node.spawn()
    node.enter(child.pid, ALICE)
    fake.process(0, child.pid, 2048)
    with caplog.at_level(logging.WARNING, logger="deviceplugin.shared.guard"):
        setup.guard.scan_once()
    reports = [r for r in caplog.records if r.getMessage().startswith("container holds more")]
    assert [getattr(r, "container", None) for r in reports] == ["team-a/train-0/main"]
    assert getattr(reports[0], "used_bytes", None) == 2048 * 2**20
    assert getattr(reports[0], "allowed_bytes", None) == 1024 * 2**20
    assert sample(setup.metrics, "guard_containers_over_grant", card="0") == 1
    assert alive(child)


def test_excess_that_ends_within_the_grace_is_not_killed(
    nvml: tuple[FakeNvml, list[Card]], node: NodeProc
) -> None:
    fake, cards = nvml
    setup = make_guard(node, cards, [holding(ALICE, 0, 4)])
    child = node.spawn()
    node.enter(child.pid, ALICE)
    fake.process(0, child.pid, 2048)
    setup.guard.scan_once()
    fake.process(0, child.pid, 512)
    setup.clock.now += GRACE_S
    setup.guard.scan_once()
    assert alive(child)
    assert sample(setup.metrics, "guard_containers_over_grant", card="0") == 0


def test_each_share_is_exported_against_its_grant_until_it_leaves_the_card(
    nvml: tuple[FakeNvml, list[Card]], node: NodeProc
) -> None:
    """Per share and card: memory used (its processes together) and granted, compute granted,
    labelled with the pod and the card's UUID and model; gone when its processes are."""
    fake, cards = nvml
    setup = make_guard(node, cards, [holding(ALICE, 0, 4, core=30)])
    first, second = node.spawn(), node.spawn()
    for child in (first, second):
        node.enter(child.pid, ALICE)
    fake.process(0, first.pid, 300)
    fake.process(0, second.pid, 200)
    setup.guard.scan_once()
    share = alice_share(cards[0])
    assert sample(setup.metrics, "share_memory_used_bytes", **share) == 500 * 2**20
    assert sample(setup.metrics, "share_memory_granted_bytes", **share) == 1024 * 2**20
    assert sample(setup.metrics, "share_compute_granted_percent", **share) == 30
    for child in (first, second):
        fake.exit(0, child.pid)
    setup.guard.scan_once()
    exported = {
        s.name
        for family in setup.metrics.registry.collect()
        for s in family.samples
        if s.name.startswith(f"{PREFIX}_share_")
    }
    assert exported == set()


@pytest.mark.parametrize(
    ("busy", "expected"),
    [
        pytest.param((25, 10), 35, id="its-processes-together"),
        pytest.param((-1, -1), 0, id="idle-no-samples"),
        pytest.param((70, 60), 100, id="never-over-the-card"),
    ],
)
def test_each_share_exports_the_compute_it_used(
    nvml: tuple[FakeNvml, list[Card]], node: NodeProc, busy: tuple[int, int], expected: float
) -> None:
    """Compute used per share and card: its processes' NVML utilisation samples summed, 0 for a
    share whose processes did not use the SMs (NVML has no sample: NOT_FOUND)."""
    fake, cards = nvml
    setup = make_guard(node, cards, [holding(ALICE, 0, 4, core=30)])
    children = [node.spawn(), node.spawn()]
    for child, percent in zip(children, busy, strict=True):
        node.enter(child.pid, ALICE)
        fake.process(0, child.pid, 100)
        fake.busy(0, child.pid, percent)
    setup.guard.scan_once()
    share = alice_share(cards[0])
    assert sample(setup.metrics, "share_compute_used_percent", **share) == expected


def test_a_card_that_does_not_sample_exports_no_compute_used(
    nvml: tuple[FakeNvml, list[Card]], node: NodeProc
) -> None:
    """Where NVML does not sample per process (MIG, some models) there is no figure: no series,
    rather than a 0 that would read as idle; memory is exported as before."""
    fake, cards = nvml
    setup = make_guard(node, cards, [holding(ALICE, 0, 4)])
    child = node.spawn()
    node.enter(child.pid, ALICE)
    fake.process(0, child.pid, 100)
    fake.busy(0, child.pid, 50)
    fake.unsampled(0)
    setup.guard.scan_once()
    share = alice_share(cards[0])
    name = f"{PREFIX}_share_compute_used_percent"
    assert setup.metrics.registry.get_sample_value(name, share) is None
    assert sample(setup.metrics, "share_memory_used_bytes", **share) == 100 * 2**20


# ---- never the wrong process ---------------------------------------------------------------


def test_pid_reused_between_scans_is_not_killed(
    nvml: tuple[FakeNvml, list[Card]], node: NodeProc
) -> None:
    fake, cards = nvml
    setup = make_guard(node, cards, [holding(ALICE, 0, 4)])
    child = node.spawn()
    node.enter(child.pid, ALICE)
    fake.process(0, child.pid, 2048)
    setup.guard.scan_once()
    node.reuse(child.pid)
    setup.clock.now += GRACE_S
    setup.guard.scan_once()
    assert alive(child)
    assert sample(setup.metrics, "guard_kills_skipped_total", reason="pid reused") == 1


def test_pid_reused_between_decision_and_kill_is_not_killed(
    nvml: tuple[FakeNvml, list[Card]], node: NodeProc
) -> None:
    fake, cards = nvml
    setup = make_guard(node, cards, [holding(ALICE, 0, 4)])
    child, small = node.spawn(), node.spawn()
    for pid, mib in ((child.pid, 2048), (small.pid, 300)):
        node.enter(pid, ALICE)
        fake.process(0, pid, mib)
    setup.guard.scan_once()
    setup.clock.now += GRACE_S
    observation = setup.guard.observe()
    node.reuse(child.pid)  # the pid names another process once the kill is decided
    setup.guard.act(observation)
    assert alive(child)
    assert alive(small)  # not killed in the place of the one that was meant
    assert sample(setup.metrics, "guard_kills_skipped_total", reason="pid reused") == 1


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        pytest.param("none", "killed", id="same-process"),
        pytest.param("reuse", "pid reused", id="start-time-differs"),
        pytest.param("move", "left the container", id="cgroup-differs"),
        pytest.param("exit", "gone", id="process-exited"),
    ],
)
def test_kill_verified(change: str, expected: str, node: NodeProc) -> None:
    child = node.spawn()
    node.enter(child.pid, ALICE)
    proc = ProcReader(node.proc)
    start = proc.start_time(child.pid)
    assert start is not None
    if change == "reuse":
        node.reuse(child.pid)
    elif change == "move":
        node.enter(child.pid, BOB)
    elif change == "exit":
        child.kill()
        child.wait()
    outcome = kill_verified(proc, child.pid, start, ContainerRef(ALICE.pod_uid, ALICE.container_id))
    assert outcome == expected
    if expected in ("killed", "gone"):
        assert killed(child)
    else:
        assert alive(child)


NOBODY = 65534
KILL_AS_NOBODY = """
import os, sys
from pathlib import Path
from deviceplugin.shared.guardkill import kill_verified
from deviceplugin.shared.guardproc import ProcReader
from deviceplugin.shared.guardtypes import ContainerRef
os.setgid({uid})
os.setuid({uid})  # from root to another user: no capability left, CAP_KILL included
print(kill_verified(ProcReader(Path(sys.argv[1])), {pid}, {start}, ContainerRef(*sys.argv[2:])))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_kill_without_cap_kill_is_not_permitted() -> None:
    # pytest's own temporary directories are private to root; this tree must be readable
    root = Path(tempfile.mkdtemp(prefix="fgkill", dir="/tmp"))
    procs = NodeProc(root)
    try:
        child = procs.spawn()
        procs.enter(child.pid, ALICE)
        start = ProcReader(procs.proc).start_time(child.pid)
        for path in (root, *root.rglob("*")):
            if not path.is_symlink():
                path.chmod(path.stat().st_mode | 0o555)
        script = KILL_AS_NOBODY.format(uid=NOBODY, pid=child.pid, start=start)
        outcome = subprocess.run(
            [sys.executable, "-c", script, str(procs.proc), ALICE.pod_uid, ALICE.container_id],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent.parent,
        ).stdout.strip()
        assert outcome == "not permitted"
        assert alive(child)
    finally:
        procs.close()
        shutil.rmtree(root, ignore_errors=True)


# ---- mapping ------------------------------------------------------------------------------


def test_log_link_of_another_pod_uid_is_not_trusted(
    nvml: tuple[FakeNvml, list[Card]], node: NodeProc
) -> None:
    """A pod deleted and created again under the same name: the cgroup's UID decides."""
    fake, cards = nvml
    setup = make_guard(node, cards, [holding(ALICE, 0, 4)])
    child = node.spawn()
    node.enter(child.pid, ALICE)
    node.log_link(ALICE, pod_uid="00000000-0000-4000-8000-000000000000")
    fake.process(0, child.pid, 4096)
    setup.guard.scan_once()
    setup.clock.now += GRACE_S
    setup.guard.scan_once()
    assert alive(child)
    assert sample(setup.metrics, "guard_foreign_processes", card="0") == 1


def test_unknown_containers_are_looked_up_with_backoff(
    nvml: tuple[FakeNvml, list[Card]], node: NodeProc
) -> None:
    fake, cards = nvml
    setup = make_guard(node, cards, [])
    child = node.spawn()
    node.enter(child.pid, STRANGER)
    fake.process(0, child.pid, 100)
    for _ in range(3):  # 1 s apart: looked up at 0 and 1, then not before 3
        setup.guard.scan_once()
        setup.clock.now += 1.0
    assert len(setup.calls) == 2


def test_container_listed_later_is_found(nvml: tuple[FakeNvml, list[Card]], node: NodeProc) -> None:
    fake, cards = nvml
    setup = make_guard(node, cards, [])
    child = node.spawn()
    node.enter(child.pid, ALICE)
    fake.process(0, child.pid, 2048)
    setup.guard.scan_once()
    setup.listed.append(holding(ALICE, 0, 4))
    setup.clock.now += 1.0
    setup.guard.scan_once()
    assert sample(setup.metrics, "guard_excess_total", card="0") == 1


def test_podresources_failure_is_no_action(
    nvml: tuple[FakeNvml, list[Card]], node: NodeProc
) -> None:
    fake, cards = nvml
    clock = Clock()

    def failing() -> list[ContainerDevices]:
        raise PodResourcesError("kubelet PodResources List on /x failed: UNAVAILABLE: down")

    owners = Owners(node.logs, failing, by_ids(cards), clock=clock)
    guard = Guard(
        cards,
        owners,
        ProcReader(node.proc),
        GuardMetrics(CollectorRegistry(), PREFIX),
        grace_s=0.0,
        clock=clock,
    )
    child = node.spawn()
    node.enter(child.pid, ALICE)
    fake.process(0, child.pid, 4096)
    guard.scan_once()
    assert alive(child)


# ---- NVML ---------------------------------------------------------------------------------


def test_nvml_error_is_no_action_and_logged_once(
    nvml: tuple[FakeNvml, list[Card]], node: NodeProc, caplog: pytest.LogCaptureFixture
) -> None:
    fake, cards = nvml
    setup = make_guard(node, cards, [holding(ALICE, 0, 4)])
    child = node.spawn()
    node.enter(child.pid, ALICE)
    fake.process(0, child.pid, 4096)
    fake.fail_processes(100)
    with caplog.at_level(logging.WARNING, logger="deviceplugin.shared.guard"):
        for _ in range(3):
            setup.guard.scan_once()
            setup.clock.now += GRACE_S
    failures = [r for r in caplog.records if "cannot read the card's processes" in r.getMessage()]
    assert len(failures) == 2  # once per card
    assert alive(child)
    assert sample(setup.metrics, "guard_excess_total", card="0") == 0
    assert sample(setup.metrics, "guard_nvml_errors_total", card="0") == 3


def test_nvml_error_during_an_excess_keeps_it(
    nvml: tuple[FakeNvml, list[Card]], node: NodeProc
) -> None:
    """A failed read is no news: the excess resumes, not restarts, when the card answers."""
    fake, cards = nvml
    setup = make_guard(node, cards, [holding(ALICE, 0, 4)])
    child = node.spawn()
    node.enter(child.pid, ALICE)
    fake.process(0, child.pid, 4096)
    setup.guard.scan_once()
    fake.fail_processes(2)  # card 0's two calls of the next scan
    setup.clock.now += GRACE_S / 2
    setup.guard.scan_once()
    assert alive(child)
    setup.clock.now += GRACE_S / 2
    setup.guard.scan_once()
    assert killed(child)


@pytest.mark.parametrize(
    ("commands", "expected"),
    [
        pytest.param([], {}, id="no-processes"),
        pytest.param([("proc", 0, 11, 5)], {11: 5 * 2**20}, id="one"),
        pytest.param(
            [("proc", 0, pid, 1) for pid in range(100, 140)],
            {pid: 2**20 for pid in range(100, 140)},
            id="more-than-the-first-guess",
        ),
        pytest.param([("proc", 0, 11, -1)], {11: None}, id="not-available"),
        pytest.param([("graphics", 0, 12, 7)], {12: 7 * 2**20}, id="graphics-only"),
        pytest.param([("proc", 0, 11, 5), ("exit", 0, 11, 0)], {}, id="exited"),
        pytest.param([("proc", 1, 11, 5)], {}, id="other-card"),
    ],
)
def test_card_processes_through_pynvml(
    commands: list[tuple[str, int, int, int]],
    expected: dict[int, int | None],
    nvml: tuple[FakeNvml, list[Card]],
) -> None:
    fake, cards = nvml
    for command, card, pid, mib in commands:
        if command == "exit":
            fake.exit(card, pid)
        else:
            fake.process(card, pid, mib, graphics=command == "graphics")
    assert card_processes(cards[0]) == expected


@pytest.mark.parametrize(
    ("buffer", "rc", "count"),
    [
        pytest.param(None, pynvml.NVML_ERROR_INSUFFICIENT_SIZE, 3, id="size-query"),
        pytest.param(1, pynvml.NVML_ERROR_INSUFFICIENT_SIZE, 3, id="too-small"),
        pytest.param(3, pynvml.NVML_SUCCESS, 3, id="exact"),
        pytest.param(8, pynvml.NVML_SUCCESS, 3, id="larger"),
    ],
)
def test_fake_process_list_follows_the_v3_contract(
    buffer: int | None, rc: int, count: int, nvml: tuple[FakeNvml, list[Card]]
) -> None:
    """The raw call, as NVML documents it, not only as pynvml happens to drive it."""
    fake, _ = nvml
    for pid in (11, 12, 13):
        fake.process(0, pid, pid)
    library = ctypes.CDLL(str(build_cached()))
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    size = ctypes.c_uint(buffer or 0)
    infos = (pynvml.c_nvmlProcessInfo_v3_t * buffer)() if buffer else None
    got = library.nvmlDeviceGetComputeRunningProcesses_v3(handle, ctypes.byref(size), infos)
    assert (got, size.value) == (rc, count)
    if infos is not None and rc == pynvml.NVML_SUCCESS:
        rows = [(i.pid, i.usedGpuMemory, i.gpuInstanceId) for i in infos[:count]]
        assert rows == [(pid, pid * 2**20, 0xFFFFFFFF) for pid in (11, 12, 13)]


# ---- the daemon's guard, end to end --------------------------------------------------------


def test_daemon_guard_kills_over_grant_container(tmp_path: Path) -> None:
    """Real plugin, strict fake kubelet (Allocate, PreStart, PodResources), guard thread."""
    procs = NodeProc(tmp_path / "node")
    try:
        with gpu_node(
            fake_cards(1, 8192),
            guard=GuardSettings(
                interval_s=0.05,
                grace_s=0.1,
                process_overhead_mib=0,
                proc_root=procs.proc,
                container_logs=procs.logs,
            ),
        ) as gpu:
            pod = Pod("team-a", "train-0", [Container("main", {CORE: 50, MEMORY: 4})])
            gpu.kubelet.admit(pod)
            gpu.kubelet.start_container(pod, "main")
            child = procs.spawn()
            procs.enter(child.pid, ALICE)
            gpu.nvml.process(0, child.pid, 1024)
            time.sleep(0.3)
            assert alive(child)  # exactly its grant
            gpu.nvml.process(0, child.pid, 1025)
            assert killed(child)
    finally:
        procs.close()
