"""Device-plugin mode on a real kubelet: allocation, freeing and restart (tests/e2e/nodeagent.py).

Runs only when FRACGPU_E2E_NODE names a node whose kubelet this machine may serve (docs/e2e.md);
otherwise every test here is skipped with that reason. The suite starts ``fracgpu device-plugin``
with four fake 24 GiB cards for that kubelet, creates pods through the run's webhooks, pinned to
the node, and stops the plugin and removes what it published at the end.

The plugin runs here with node placement (it picks each container's card as kubelet admits
it): the fallback for clusters that cannot run fracgpu's scheduler. The suite's churn runs
through the installed release, whose placement is the extender's (test_e2e_extender.py): under
churn on a node of several cards, node placement can lose the race the extender removes.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from typing import Any

import pytest

from core.labels import MODEL_ANNOTATION, PRODUCT_LABEL, label_value
from core.units import BLOCK_MIB, CORE, MEMORY
from deviceplugin.classic.settling import SETTLE_S
from tests.e2e.harness import (
    CARD_PRODUCT,
    ENV_NODE,
    HarnessError,
    Kubectl,
    Run,
    Settings,
    delete_namespace,
)
from tests.e2e.nodeagent import (
    NodeAgent,
    a_burst_is_lent_idle_compute_and_a_cap_is_not,
    create,
    describe,
    fake_cards,
    guard_kills_over_grant,
    node_metadata,
    node_pod,
    pods,
    top_shows_live_use,
    unpublish,
    wait_for,
    wait_running,
)
from tests.e2e.scenarios import UNHONOURABLE_MODEL_CHOICES, manifest

Obj = dict[str, Any]
MIB = 1024 * 1024
CARDS = fake_cards()
FULL = {CORE: str(100 * len(CARDS)), MEMORY: str(len(CARDS) * CARDS[0].memory_mib // BLOCK_MIB)}
# Capacity freed by deleted pods must be advertised again within 2 s of their end; kubelet
# publishes a Node's allocatable with its status, every 10 s by default; then the scheduler
# retries the waiting pod on that Node update (its backoff is still short): 2 + 10 + 5 s.
FREED_WITHIN_S = 17.0
# Pods the freeing scenarios delete are deleted gracefully (see node_pod); pause stops at once.
GRACE_S = 2


@pytest.fixture(scope="module")
def agent(
    settings: Settings, kubectl: Kubectl, request: pytest.FixtureRequest
) -> Iterator[NodeAgent]:
    node = settings.node
    if node is None:
        pytest.skip(f"device-plugin scenarios: set {ENV_NODE} to a node the suite may serve")
    e2e: Run = request.getfixturevalue("e2e")  # only now: without a node there is nothing to set up
    before = e2e.portal.run(node_metadata(e2e.api, node))
    node_agent = NodeAgent(settings, e2e.run_id, CARDS, e2e.webhook.log_path.parent)
    try:
        node_agent.prepare()
        node_agent.start()
        wait_for(node_agent.registered, 60, node_agent.log)
        wait_for(lambda: allocatable(kubectl, node) == FULL, 60, node_agent.log)
        yield node_agent
    except HarnessError as err:
        pytest.fail(str(err))
    finally:
        node_agent.stop()
        e2e.portal.run(unpublish(e2e.api, node, before))
        node_agent.remove_files()


def allocatable(kubectl: Kubectl, node: str) -> dict[str, str]:
    status = json.loads(kubectl.ok("get", "node", node, "-o", "json"))["status"]
    return {k: v for k, v in (status.get("allocatable") or {}).items() if k in (CORE, MEMORY)}


@pytest.fixture
def node_namespace(e2e: Run, kubectl: Kubectl) -> Iterator[str]:
    """A namespace whose pods are all gone (not just deleted) after the test, so the next test
    starts on an empty node."""
    name = e2e.namespace(f"node-{secrets.token_hex(2)}")
    try:
        yield name
    finally:
        kubectl("delete", "pods", "--all", "-n", name, "--grace-period=0", "--force")
        wait_for(lambda: not pods(kubectl, name), 60, lambda: f"pods of {name} remain")
        e2e.portal.run(delete_namespace(e2e.api, name))


def _condition(pod: Obj, kind: str) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == kind and c.get("status") == "True" for c in conditions)


def granted(pod: Obj) -> tuple[int, int]:
    """The (core, memory MiB per card) the API server stored for the pod's container. Whole
    cards carry fracgpu.io/core alone (the webhook's canonical form) and get each card whole."""
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    core = int(limits[CORE])
    if MEMORY not in limits:
        assert core % 100 == 0, f"a share without {MEMORY}: {limits}"
        return core, CARDS[0].memory_mib
    return core, int(limits[MEMORY]) * BLOCK_MIB // max(core // 100, 1)


ALLOCATIONS = [
    pytest.param({"fracgpu.io/gpu": "0.5"}, id="half-card"),
    pytest.param({"fracgpu.io/gpu": "0.3", "fracgpu.io/gpumem": "4Gi"}, id="fraction-and-memory"),
    pytest.param({"fracgpu.io/gpu": "2"}, id="two-cards"),
]


@pytest.mark.parametrize("limits", ALLOCATIONS)
def test_pod_runs_with_the_limits_it_was_granted(
    agent: NodeAgent, kubectl: Kubectl, node_namespace: str, limits: Obj
) -> None:
    before = agent.written()
    stored = create(kubectl, node_namespace, node_pod("gpu", agent.node, limits))
    wait_running(kubectl, node_namespace, "gpu", agent)
    core, mib_per_card = granted(stored)
    cards = max(core // 100, 1)
    (written,) = agent.limits(before)
    assert len(written.devices) == cards
    assert set(written.devices) <= {c.uuid for c in CARDS}
    assert written.compute_percent == min(core, 100)
    assert written.memory_bytes == mib_per_card * MIB


def test_the_guard_kills_a_process_over_its_grant(
    agent: NodeAgent, kubectl: Kubectl, node_namespace: str
) -> None:
    """The node guard in device-plugin mode on the real kubelet: PodResources names the
    container's device IDs, their directory's limits file is the grant (its card too)."""
    before = agent.written()
    limits = {"fracgpu.io/gpu": "0.3", "fracgpu.io/gpumem": "1Gi"}
    create(kubectl, node_namespace, node_pod("greedy", agent.node, limits))
    wait_running(kubectl, node_namespace, "greedy", agent)
    (grant,) = agent.limits(before)
    (index,) = [i for i, card in enumerate(CARDS) if card.uuid in grant.devices]
    guard_kills_over_grant(agent, kubectl, node_namespace, "greedy", card=index, grant_mib=1024)


def test_top_shows_what_a_share_uses_on_its_card(
    agent: NodeAgent, kubectl: Kubectl, node_namespace: str
) -> None:
    """Device-plugin mode: only the node agent knows which card holds a share; its metrics
    say it, and `kubectl fracgpu top` shows the share on that card with its live use."""
    before = agent.written()
    create(kubectl, node_namespace, node_pod("busy", agent.node, {"fracgpu.io/gpu": "0.3"}))
    wait_running(kubectl, node_namespace, "busy", agent)
    (written,) = agent.limits(before)
    card = next(i for i, c in enumerate(CARDS) if c.uuid == written.devices[0])
    top_shows_live_use(agent, kubectl, node_namespace, "busy", card=card,
                       label="fracgpu-device-plugin")  # fmt: skip


def run_half_cards(agent: NodeAgent, kubectl: Kubectl, namespace: str) -> None:
    """Two 0.5-card pods per card with 1 GiB each, created at once, until all run."""
    names = [f"small-{i}" for i in range(2 * len(CARDS))]
    for name in names:
        limits = {"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "1024"}
        create(kubectl, namespace, node_pod(name, agent.node, limits, grace_s=GRACE_S))
    for name in names:
        wait_running(kubectl, namespace, name, agent)


def test_capacity_of_deleted_pods_is_usable_again(
    agent: NodeAgent, kubectl: Kubectl, node_namespace: str
) -> None:
    # Two 0.5-card pods with little memory per card: every card's compute is used up while
    # most of its memory is free, the case where a plugin must not keep advertising less.
    run_half_cards(agent, kubectl, node_namespace)
    kubectl.ok("delete", "pods", "--all", "-n", node_namespace)
    wait_for(lambda: not pods(kubectl, node_namespace), 60, lambda: "the pods were not deleted")
    create(kubectl, node_namespace, node_pod("after", agent.node, {"fracgpu.io/gpu": "0.5"}))
    elapsed = wait_for(
        lambda: _condition(kubectl.get("pod", "after", node_namespace), "PodScheduled"),
        FREED_WITHIN_S,
        lambda: describe(kubectl, node_namespace, agent),
    )
    print(f"a 0.5 pod was scheduled {elapsed:.1f}s after the node's pods were gone")
    wait_running(kubectl, node_namespace, "after", agent)


def test_plugin_restart_keeps_running_pods_and_allocates_again(
    agent: NodeAgent, kubectl: Kubectl, node_namespace: str
) -> None:
    create(kubectl, node_namespace, node_pod("before", agent.node, {"fracgpu.io/gpu": "0.5"}))
    wait_running(kubectl, node_namespace, "before", agent)
    agent.stop()
    agent.start()
    wait_for(agent.registered, 60, agent.log)
    before = agent.written()
    create(kubectl, node_namespace, node_pod("after", agent.node, {"fracgpu.io/gpu": "0.5"}))
    wait_running(kubectl, node_namespace, "after", agent)
    status = kubectl.get("pod", "before", node_namespace)["status"]
    assert status["phase"] == "Running"
    assert [c["restartCount"] for c in status["containerStatuses"]] == [0]
    assert agent.exited() is None, agent.log()
    assert 50 in [written.compute_percent for written in agent.limits(before)]


def test_no_share_fails_right_after_a_multi_card_pod_is_freed(
    agent: NodeAgent, kubectl: Kubectl, node_namespace: str
) -> None:
    """kubelet picks each resource's device IDs from what it believes free and takes the
    plugin's preference as a hint only; a moment after a pod ends, its view and the plugin's
    lists differ, and a real 1.36 kubelet then gave one container core IDs of one card and
    memory IDs of another (the fake kubelet always took the preference). IDs are counts now:
    the plugin places each container from its own ledger, whatever IDs kubelet picks."""
    wide = node_pod("wide", agent.node, {"fracgpu.io/gpu": "2"}, grace_s=GRACE_S)
    create(kubectl, node_namespace, wide)
    wait_running(kubectl, node_namespace, "wide", agent)
    kubectl.ok("delete", "pod", "wide", "-n", node_namespace)
    wait_for(lambda: not pods(kubectl, node_namespace), 60, lambda: "the pod was not deleted")
    run_half_cards(agent, kubectl, node_namespace)


def test_a_share_no_card_can_host_waits_pending_and_is_told_why(
    agent: NodeAgent, kubectl: Kubectl, node_namespace: str
) -> None:
    """0.6 of every card in use: a 0.5 pod fits the node's sums no more (the honesty rule) and
    waits Pending, never Failed; the webhook tells it why in cards and MiB, from what each
    card has free (the plugin's Node annotation)."""
    for i in range(len(CARDS)):
        limits = {"fracgpu.io/gpu": "0.6", "fracgpu.io/gpumem": "2Gi"}
        create(kubectl, node_namespace, node_pod(f"big-{i}", agent.node, limits))
    for i in range(len(CARDS)):
        wait_running(kubectl, node_namespace, f"big-{i}", agent)
    # Each placement hid the previous open card's rest, which the Node's allocatable keeps for
    # SETTLE_S and kubelet's lists for twice as long (a pod bound meanwhile is admitted, and
    # waits for a card): past that moment, when the Node offers 0.4 beside what is allocated.
    time.sleep(2 * SETTLE_S)
    wait_for(
        lambda: allocatable(kubectl, agent.node).get(CORE) == str(60 * len(CARDS) + 40),
        15,
        lambda: f"allocatable {allocatable(kubectl, agent.node)}\n{agent.log()}",
    )
    create(kubectl, node_namespace, node_pod("late", agent.node, {"fracgpu.io/gpu": "0.5"}))

    def told() -> str | None:
        events = kubectl.ok(
            "get", "events", "-n", node_namespace, "--field-selector",
            "involvedObject.name=late,reason=GPUShareDoesNotFit", "-o", "json",
        )  # fmt: skip
        items = json.loads(events)["items"]
        return str(items[-1]["message"]) if items else None

    wait_for(lambda: told() is not None, 45, lambda: describe(kubectl, node_namespace, agent))
    message = told()
    assert message is not None
    assert message.startswith("largest free share on any node: 0.40 card and "), message
    assert f"of {agent.node}; this pod asks 0.50 card and " in message, message
    # What a user runs: the same sentence, worked out afresh from the Node's annotation.
    why = kubectl.fracgpu("why", "late", "-n", node_namespace, "-o", "json")
    assert why.returncode == 0, why.stderr
    found = json.loads(why.stdout)
    assert (found["state"], found["mode"]) == ("waiting-for-a-card", "device-plugin"), found
    assert found["message"] == f"no card can host it now: {message}", found
    # Each card and the node's shares, and which cards could take a shape now.
    top = kubectl.fracgpu("top", "--node", agent.node, "-o", "json")
    assert top.returncode == 0, top.stderr
    view = json.loads(top.stdout)
    assert (view["mode"], len(view["cards"])) == ("device-plugin", len(CARDS)), view
    assert [c["free_cores"] for c in view["cards"]] == [40] * len(CARDS), view
    held = {s["pod"] for s in view["unplaced"][agent.node] if s["namespace"] == node_namespace}
    assert held >= {f"big-{i}" for i in range(len(CARDS))}, view
    nowhere = kubectl.fracgpu("fit", "0.5", "--gpumem", "1Gi")
    assert nowhere.returncode == 1, nowhere.stdout + nowhere.stderr
    assert "fits nowhere now: largest free share on any node: 0.40 card" in nowhere.stdout
    somewhere = kubectl.fracgpu("fit", "0.4", "--gpumem", "1Gi", "-o", "json")
    assert somewhere.returncode == 0, somewhere.stdout + somewhere.stderr
    assert len(json.loads(somewhere.stdout)["fits"]) == len(CARDS)
    status = kubectl.get("pod", "late", node_namespace)["status"]
    assert status["phase"] == "Pending"
    assert not _condition(kubectl.get("pod", "late", node_namespace), "PodScheduled")


# Choosing the GPU model in the pod's annotations (issue #28 item 4). The fake cards are
# CARD_PRODUCT, which the run's webhook knows (its inventory) and the node label spells
# label-safe; admission writes the node affinity that keeps the pod on them.


def _model_pod(name: str, node: str, annotations: dict[str, str]) -> Obj:
    obj = node_pod(name, node, {"fracgpu.io/gpu": "0.5"})
    obj["metadata"]["annotations"] = annotations
    return obj


def test_a_pod_that_chooses_the_cards_model_gets_its_affinity_and_runs(
    agent: NodeAgent, kubectl: Kubectl, node_namespace: str
) -> None:
    annotations = {MODEL_ANNOTATION: CARD_PRODUCT.lower()}  # any case: the cluster's spelling
    stored = create(kubectl, node_namespace, _model_pod("chosen", agent.node, annotations))
    (term,) = stored["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    wanted = {"key": PRODUCT_LABEL, "operator": "In", "values": [label_value(CARD_PRODUCT)]}
    assert term["matchExpressions"] == [wanted], term  # ANDed with the pod's own node term
    assert term["matchFields"][0]["values"] == [agent.node], term
    wait_running(kubectl, node_namespace, "chosen", agent)


@pytest.mark.parametrize(("annotations", "said"), UNHONOURABLE_MODEL_CHOICES)
def test_a_model_choice_fracgpu_cannot_honour_is_denied_at_create(
    kubectl: Kubectl, node_namespace: str, annotations: dict[str, str], said: str
) -> None:
    obj = _model_pod("denied", "any-node", annotations)
    proc = kubectl("create", "-n", node_namespace, "-f", "-", stdin=manifest(obj))
    assert proc.returncode != 0
    assert said in proc.stderr, proc.stderr
    assert f"known: {CARD_PRODUCT}" in proc.stderr, proc.stderr
    assert kubectl("get", "pod", "denied", "-n", node_namespace).returncode != 0


def test_a_share_that_may_burst_is_lent_idle_compute_and_a_hard_cap_is_not(
    agent: NodeAgent, kubectl: Kubectl, node_namespace: str
) -> None:
    """Device-plugin mode: the policy read from the pod's annotation; the usage file written
    where the hook reads it."""
    a_burst_is_lent_idle_compute_and_a_cap_is_not(agent, kubectl, node_namespace)
