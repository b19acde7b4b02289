"""Device-plugin mode placed by the scheduler extender, as the Helm chart installs it (#38).

The release is installed in device-plugin mode with ``placement: extender`` (the chart's
fracgpu-scheduler profile calls ``fracgpu serve``'s extender; the node agent places each
container on the card its pod's ``fracgpu.io/placement`` record names). Through the installed
pods only:

* every share lands on the card its record names, and the records never put more on a card
  than it holds;
* the suite's churn of shares and whole cards, ten rounds in a row, fails no pod: no
  ``UnexpectedAdmissionError``, no Failed phase, nothing refused at PreStartContainer;
* a share no card can hold waits Pending with the extender's reason, in the user's units.

Runs in the release session (FRACGPU_E2E_RELEASE_NODE), after test_e2e_release.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from core.placement import PLACEMENT_ANNOTATION, read
from tests.e2e.harness import Kubectl, Settings
from tests.e2e.release import (
    CARDS,
    SKIP_REASON,
    Release,
    create_running,
    events,
    installed,
    limits_inside,
    release_node_of,
    release_state,
    share_pod,
    wait_for,
)
from tests.e2e.release import user_namespace as user_namespace_of
from tests.e2e.scenarios import manifest

Obj = dict[str, Any]
ROUNDS = 10
# What a user sets to have device-plugin mode placed by the extender (docs/install.md). The
# project's cluster runs no cluster DNS, so its scheduler dials the extender at the webhook
# Service's IP, pinned here inside the cluster's service range (the TLS server name stays the
# Service's DNS name).
EXTENDER_IP = "10.96.211.44"
EXTENDER_VALUES: Obj = {
    "placement": "extender",
    "webhook": {"serviceClusterIP": EXTENDER_IP},
    "scheduler": {"extenderHost": EXTENDER_IP},
}


@pytest.fixture(scope="module")
def release(
    settings: Settings, kubectl: Kubectl, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Release]:
    node = release_node_of(settings)
    if node is None:
        pytest.skip(SKIP_REASON)
    workdir = tmp_path_factory.mktemp("release-extender")
    with installed(
        "device-plugin", node, settings, kubectl, workdir, extra_values=EXTENDER_VALUES
    ) as run:
        yield run


@pytest.fixture
def user_namespace(release: Release, kubectl: Kubectl) -> Iterator[str]:
    with user_namespace_of(kubectl) as name:
        yield name


def recorded_card(pod: Obj) -> str:
    record = read(pod["metadata"].get("annotations") or {}, pod=pod["metadata"]["name"])
    assert record is not None, f"{pod['metadata']['name']}: no {PLACEMENT_ANNOTATION} record"
    ((_, placement),) = record.containers.items()
    (card,) = placement.cards
    return card


def test_every_share_lands_on_its_recorded_card(
    release: Release, kubectl: Kubectl, user_namespace: str
) -> None:
    """Four half cards on two cards: the extender fills both exactly, each container's limits
    name the card its record does, and no card holds more than 100 hundredths."""
    held: dict[str, int] = {}
    for i in range(2 * len(CARDS)):
        name = f"half-{i}"
        pod = create_running(kubectl, user_namespace, share_pod(name, "0.5", "4Gi"))
        assert pod["spec"].get("schedulerName") == "fracgpu-scheduler", pod["spec"]
        card = recorded_card(pod)
        assert tuple(limits_inside(kubectl, user_namespace, name).devices) == (card,)
        held[card] = held.get(card, 0) + 50
    assert held == {c.uuid: 100 for c in CARDS}


def test_a_share_no_card_can_hold_waits_with_the_reason(
    release: Release, kubectl: Kubectl, user_namespace: str
) -> None:
    """Both cards half taken: a 0.75 share waits Pending, and the scheduler's event carries
    the extender's reason in cards and MiB; nothing fails."""
    for i in range(len(CARDS)):
        create_running(kubectl, user_namespace, share_pod(f"taken-{i}", "0.5", "4Gi"))
    kubectl.ok("create", "-n", user_namespace, "-f", "-",
               stdin=manifest(share_pod("too-big", "0.75", "4Gi")))  # fmt: skip

    def explained() -> bool:
        pod = kubectl.get("pod", "too-big", user_namespace)
        assert pod["status"].get("phase") == "Pending", pod["status"]
        return "card" in events(kubectl, user_namespace) and "FailedScheduling" in events(
            kubectl, user_namespace
        )

    wait_for(explained, 60, lambda: events(kubectl, user_namespace))


def test_churn_of_shares_and_whole_cards_fails_no_pod_ten_times(
    release: Release, kubectl: Kubectl, user_namespace: str
) -> None:
    """Ten rounds of: a whole card, two quarter cards and a half card created at once, then all
    deleted. Every pod the scheduler bound runs on its recorded card; a pod no card can hold
    (the shares may have split the two cards) waits unbound; no pod ever fails on the node."""
    shapes = [("whole", "1", "24Gi"), ("q1", "0.25", "2Gi"), ("q2", "0.25", "2Gi"),
              ("h", "0.5", "4Gi")]  # fmt: skip
    ran = 0
    for round_ in range(ROUNDS):
        names = [f"r{round_}-{n}" for n, _, _ in shapes]
        for name, (_, gpu, mem) in zip(names, shapes, strict=True):
            kubectl.ok("create", "-n", user_namespace, "-f", "-",
                       stdin=manifest(share_pod(name, gpu, mem)))  # fmt: skip

        def settled(round_: int = round_, names: list[str] = names) -> bool:
            """Every bound pod Running, every other one Pending and unbound; none Failed."""
            pods = json.loads(kubectl.ok("get", "pods", "-n", user_namespace, "-o", "json"))
            by_name = {p["metadata"]["name"]: p for p in pods["items"]}
            phases = {n: by_name[n]["status"].get("phase") for n in names if n in by_name}
            failed = [n for n, phase in phases.items() if phase == "Failed"]
            assert not failed, (round_, phases, events(kubectl, user_namespace))
            bound = {n for n in phases if by_name[n]["spec"].get("nodeName")}
            waiting = {n for n, phase in phases.items() if phase == "Pending" and n not in bound}
            running = {n for n in bound if phases[n] == "Running"}
            return len(phases) == len(names) and running | waiting == set(names) and bool(running)

        state = lambda: f"{events(kubectl, user_namespace)}\n{release_state(kubectl)}"  # noqa: E731
        wait_for(settled, 120, state)
        held: dict[str, int] = {}
        for name in names:
            pod = kubectl.get("pod", name, user_namespace)
            if pod["status"].get("phase") != "Running":
                continue
            card = recorded_card(pod)
            assert limits_inside(kubectl, user_namespace, name).devices[0] == card
            core = int(pod["spec"]["containers"][0]["resources"]["limits"]["fracgpu.io/core"])
            held[card] = held.get(card, 0) + core
            ran += 1
        assert all(v <= 100 for v in held.values()), (round_, held)
        kubectl.ok("delete", "pods", "-n", user_namespace, *names, "--wait=true", timeout=120)
    assert ran >= 2 * ROUNDS, ran
    assert "UnexpectedAdmissionError" not in events(kubectl, user_namespace)
