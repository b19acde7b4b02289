"""deviceplugin/shared/guardowners.py: from a cgroup's container to its fracgpu container and
grant, through kubelet's log link and PodResources, cached, unknown containers backed off."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from core.contract import Limits
from deviceplugin.shared.guardowners import (
    FORGET_AFTER_S,
    MAX_MISS_RETRY_S,
    GrantError,
    Owners,
    parse_log_target,
)
from deviceplugin.shared.guardtypes import ContainerRef, Owner
from deviceplugin.shared.podresources import ContainerDevices, PodResourcesError
from testkit.nodeproc import FakeContainer, NodeProc, container

UID = "6f1c2a8e-1b2c-4d5e-8f90-0123456789ab"
ALICE = container("team-a", "train-0", "main")
LIMITS = Limits(("GPU-0",), 1 << 30, 50)


@pytest.mark.parametrize(
    ("target", "pod_uid", "expected"),
    [
        pytest.param(
            f"/var/log/pods/ns_pod_{UID}/main/0.log", UID, ("ns", "pod", "main"), id="kubelet"
        ),
        pytest.param(
            f"../../pods/team-a_train-0_{UID}/side-car/3.log",
            UID,
            ("team-a", "train-0", "side-car"),
            id="relative-dashes",
        ),
        pytest.param(
            f"/var/log/pods/ns_pod_{UID}/main/0.log",
            "00000000-0000-4000-8000-000000000000",
            None,
            id="another-pods-uid",
        ),
        pytest.param(
            f"/var/log/pods/ns_pod_{'a' * 32}/c/0.log",
            "a" * 32,
            ("ns", "pod", "c"),
            id="static-pod-hash-uid",
        ),
        pytest.param("/var/log/pods/ns_pod/main/0.log", UID, None, id="no-uid"),
        pytest.param("/var/log/messages", UID, None, id="not-a-pod-log"),
    ],
)
def test_parse_log_target(target: str, pod_uid: str, expected: tuple[str, str, str] | None) -> None:
    assert parse_log_target(target, pod_uid) == expected


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Kubelet:
    """PodResources as the agent lists it, and the grants the agent would name."""

    listed: list[ContainerDevices] = field(default_factory=list)
    error: str | None = None
    grant_error: str | None = None
    calls: int = 0

    def list(self) -> list[ContainerDevices]:
        self.calls += 1
        if self.error is not None:
            raise PodResourcesError(self.error)
        return self.listed

    def grant(self, entry: ContainerDevices) -> tuple[str, Limits]:
        if self.grant_error is not None:
            raise GrantError(self.grant_error)
        return f"/grants/{entry.name}", LIMITS


def listed(target: FakeContainer) -> ContainerDevices:
    return ContainerDevices(target.namespace, target.pod, target.container, {})


def ref(target: FakeContainer) -> ContainerRef:
    return ContainerRef(target.pod_uid, target.container_id)


@pytest.fixture
def node(tmp_path: Path) -> NodeProc:
    return NodeProc(tmp_path)  # no process spawned: only the log links are used


def owners_of(node: NodeProc, kubelet: Kubelet, clock: Clock) -> Owners:
    return Owners(node.logs, kubelet.list, kubelet.grant, clock=clock)


ALICE_OWNER = Owner(
    ALICE.namespace,
    ALICE.pod,
    ALICE.container,
    ALICE.pod_uid,
    ALICE.container_id,
    LIMITS,
    "/grants/team-a/train-0/main",
)


OTHER_UID = "00000000-0000-4000-8000-000000000000"


@dataclass(frozen=True)
class Node:
    """What kubelet shows of ALICE's container."""

    link_uid: str | None = ALICE.pod_uid  # the pod UID its log link names (None: no link)
    listed: bool = True  # in PodResources' List
    podresources_error: str | None = None
    grant_error: str | None = None


@pytest.mark.parametrize(
    ("seen", "expected"),
    [
        pytest.param(Node(), ALICE_OWNER, id="linked-and-listed"),
        pytest.param(Node(link_uid=None), None, id="no-log-link"),
        pytest.param(Node(link_uid=OTHER_UID), None, id="log-link-of-another-pod"),
        pytest.param(Node(listed=False), None, id="not-listed-no-fracgpu-resource"),
        pytest.param(Node(podresources_error="UNAVAILABLE"), None, id="podresources-down"),
        pytest.param(Node(grant_error="no limits file"), None, id="no-grant-yet"),
    ],
)
def test_resolve(node: NodeProc, seen: Node, expected: Owner | None) -> None:
    if seen.link_uid is not None:
        node.log_link(ALICE, pod_uid=seen.link_uid)
    kubelet = Kubelet(
        [listed(ALICE)] if seen.listed else [],
        error=seen.podresources_error,
        grant_error=seen.grant_error,
    )
    assert owners_of(node, kubelet, Clock()).resolve(ref(ALICE)) == expected


@pytest.mark.parametrize(
    ("asks_at", "calls"),
    [
        pytest.param([0, 0.5, 0.9], 1, id="within-the-first-wait"),
        pytest.param([0, 1, 2, 3], 3, id="doubling-1-then-2"),
        pytest.param([0, 1, 3, 7, 15], 5, id="doubling-each-miss"),
        pytest.param([0, 1, 3, 7, 15, 31, 63, 123, 183], 9, id="capped-at-a-minute"),
        pytest.param([0, 1, 3, 7, 15, 31, 63, 122], 7, id="not-before-the-cap"),
    ],
)
def test_misses_are_retried_with_backoff(node: NodeProc, asks_at: list[float], calls: int) -> None:
    assert MAX_MISS_RETRY_S == 60.0
    kubelet, clock = Kubelet(), Clock()
    node.log_link(ALICE)  # linked, never listed: a foreign GPU container
    owners = owners_of(node, kubelet, clock)
    start = clock.now
    for at in asks_at:
        clock.now = start + at
        assert owners.resolve(ref(ALICE)) is None
    assert kubelet.calls == calls


@pytest.mark.parametrize(
    ("idle_s", "calls"),
    [
        pytest.param(FORGET_AFTER_S - 1, 1, id="kept-while-asked-about"),
        pytest.param(FORGET_AFTER_S + 1, 2, id="forgotten-after-idle"),
    ],
)
def test_known_owners_are_cached_until_idle(node: NodeProc, idle_s: float, calls: int) -> None:
    kubelet, clock = Kubelet([listed(ALICE)]), Clock()
    node.log_link(ALICE)
    owners = owners_of(node, kubelet, clock)
    assert owners.resolve(ref(ALICE)) == ALICE_OWNER
    clock.now += idle_s
    owners.forget_idle()
    assert owners.resolve(ref(ALICE)) == ALICE_OWNER
    assert kubelet.calls == calls
