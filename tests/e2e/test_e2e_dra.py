"""DRA mode on a real Kubernetes 1.36 cluster: shares placed exactly by the stock scheduler.

Runs only when FRACGPU_E2E_DRA_NODE names a node whose kubelet this machine may serve
(docs/e2e.md); otherwise every test here is skipped with that reason. The suite starts a second
local webhook in DRA mode (``allocation: dra``, its own webhook configurations and namespaces,
the DeviceClass of deploy/overlays/dra if the cluster lacks it) and ``fracgpu dra-plugin`` with
four fake 24 GiB cards for that kubelet (tests/e2e/nodeagent.py), creates pods through the DRA
webhooks pinned to the node, and removes all of it at the end.

What a scenario expects of a placement is read from what the scheduler stored (each pod's
ResourceClaim and its allocation), and what a waiting pod is told is computed by the webhook's
own code from the cluster's slices and claims, never written into the test.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from core import contract, dra
from core.labels import MODEL_ANNOTATION
from core.units import ENV_GPU, ENV_GPU_COUNT, ENV_MEMORY_MIB
from tests.e2e.harness import (
    ADMISSION_DRA,
    CARD_PRODUCT,
    DEPLOY,
    ENV_DRA_NODE,
    HarnessError,
    Kubectl,
    Run,
    Settings,
    delete_namespace,
    e2e_run,
    render,
    sigterm_interrupts,
    wait_until_admission_effective,
)
from tests.e2e.nodeagent import (
    DraAgent,
    a_burst_is_lent_idle_compute_and_a_cap_is_not,
    consumed,
    consumed_of,
    create,
    describe,
    fake_cards,
    guard_kills_over_grant,
    node_pod,
    pods,
    results,
    top_shows_live_use,
    wait_for,
    wait_running,
)
from tests.e2e.scenarios import (
    SHELL_IMAGE,
    UNHONOURABLE_MODEL_CHOICES,
    gpu_pod,
    gpu_quota,
    manifest,
)
from webhook.waiting import REASON, asks_of, explain, free_cards

Obj = dict[str, Any]
MIB = 1024 * 1024
CARDS = fake_cards()
# The scheduler's reason for a pod whose claim fits no device (the same words for fragmentation,
# a request over a card's size and a node without a slice).
UNSCHEDULABLE = "cannot allocate all claims"
# The waiting-pod explainer runs every 10 s; an Event within two passes and a margin.
EXPLAINED_WITHIN_S = 30.0
# kubelet wipes a node's slices when it restarts; the plugin puts its own back (target 2 s).
REPUBLISHED_WITHIN_S = 5.0
# A claim is deallocated when its pod is gone, and the scheduler retries a waiting pod on that
# claim update (its backoff is still short): no node status period is involved, unlike the
# device-plugin mode's 17 s.
FREED_WITHIN_S = 20.0
PENDING_FOR_S = 10.0  # how long a waiting pod is watched for a phase other than Pending


@pytest.fixture(scope="module")
def dra_run(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    if settings.dra_node is None:
        pytest.skip(
            f"DRA scenarios: set {ENV_DRA_NODE} to a node of a Kubernetes >= 1.36 cluster whose "
            f"kubelet the suite may serve (docs/e2e.md)"
        )
    run_id = f"{secrets.token_hex(3)}d"
    workdir = tmp_path_factory.mktemp(f"e2e-{run_id}")
    try:
        with (
            sigterm_interrupts(),
            e2e_run(settings, workdir, run_id, admission=ADMISSION_DRA, port_offset=1) as run,
        ):
            probe = run.namespace("probe")
            # A whole card: in DRA mode it needs no GPU model, and no slice exists yet.
            run.portal.run(wait_until_admission_effective(run.api, probe, gpu_pod("probe", "1")))
            yield run
    except HarnessError as err:
        pytest.fail(str(err))


def slices(kubectl: Kubectl, node: str) -> list[Obj]:
    selector = f"spec.nodeName={node},spec.driver={dra.DRIVER}"
    out = kubectl.ok("get", "resourceslices", "--field-selector", selector, "-o", "json")
    items: list[Obj] = json.loads(out)["items"]
    return items


def device_names(kubectl: Kubectl, node: str) -> list[str]:
    return sorted(d["name"] for s in slices(kubectl, node) for d in s["spec"].get("devices") or [])


@pytest.fixture(scope="module")
def agent(dra_run: Run, settings: Settings, kubectl: Kubectl) -> Iterator[DraAgent]:
    node_agent = DraAgent(settings, dra_run.run_id, CARDS, dra_run.webhook.log_path.parent)
    try:
        node_agent.prepare()
        node_agent.start()
        wait_for(node_agent.registered, 60, node_agent.log)
        wait_for(lambda: len(device_names(kubectl, node_agent.node)) == len(CARDS), 60,
                 node_agent.log)  # fmt: skip
        yield node_agent
    except HarnessError as err:
        pytest.fail(str(err))
    finally:
        node_agent.stop()
        # kubelet wipes a gone plugin's slices itself, after a delay: do not leave them to it.
        kubectl("delete", "resourceslices", "--field-selector",
                f"spec.nodeName={node_agent.node},spec.driver={dra.DRIVER}")  # fmt: skip
        node_agent.remove_files()


@pytest.fixture
def dra_namespace(dra_run: Run, kubectl: Kubectl) -> Iterator[str]:
    """A namespace of the DRA webhooks whose pods are all gone (their claims deallocated) after
    the test, so the next test starts on empty cards."""
    name = dra_run.namespace(f"dra-{secrets.token_hex(2)}")
    try:
        yield name
    finally:
        kubectl("delete", "pods", "--all", "-n", name, "--grace-period=0", "--force")
        wait_for(lambda: not pods(kubectl, name), 60, lambda: f"pods of {name} remain")
        # The pods' claims are deleted after them (kube-controller-manager): only then are their
        # cards free for the next test's first-fit expectations.
        wait_for(lambda: not claims(kubectl, name), 60, lambda: f"claims of {name} remain")
        dra_run.portal.run(delete_namespace(dra_run.api, name))


def claims(kubectl: Kubectl, namespace: str) -> list[Obj]:
    out = kubectl.ok("get", "resourceclaims", "-n", namespace, "-o", "json")
    items: list[Obj] = json.loads(out)["items"]
    return items


def share(gpu: str, gpumem: str | None = None) -> Obj:
    limits = {"fracgpu.io/gpu": gpu}
    if gpumem is not None:
        limits["fracgpu.io/gpumem"] = gpumem
    return limits


def claim_of(kubectl: Kubectl, namespace: str, pod: str) -> Obj:
    """The ResourceClaim made for the pod's GPU container (the one claim a container may hold)."""
    statuses = kubectl.get("pod", pod, namespace)["status"].get("resourceClaimStatuses") or []
    (entry,) = statuses
    return kubectl.get("resourceclaim", entry["resourceClaimName"], namespace)


def cards_of(kubectl: Kubectl, namespace: str, pod: str) -> list[str]:
    return sorted(r["device"] for r in results(claim_of(kubectl, namespace, pod)))


def _condition(pod: Obj, kind: str) -> Obj | None:
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == kind:
            found: Obj = condition
            return found
    return None


def wait_unschedulable(kubectl: Kubectl, namespace: str, name: str, agent: DraAgent) -> Obj:
    """Until the scheduler says the pod's claim fits no card; the pod as it then is."""

    def unschedulable() -> bool:
        condition = _condition(kubectl.get("pod", name, namespace), "PodScheduled") or {}
        return condition.get("status") == "False" and UNSCHEDULABLE in condition.get("message", "")

    wait_for(unschedulable, 60, lambda: describe(kubectl, namespace, agent))
    return kubectl.get("pod", name, namespace)


def events_of(kubectl: Kubectl, namespace: str, pod: str, reason: str) -> list[Obj]:
    selector = f"involvedObject.name={pod},reason={reason}"
    out = kubectl.ok("get", "events", "-n", namespace, "--field-selector", selector, "-o", "json")
    items: list[Obj] = json.loads(out)["items"]
    return items


def test_shares_pack_onto_one_card_with_the_limits_they_consumed(
    agent: DraAgent, kubectl: Kubectl, dra_namespace: str
) -> None:
    before = agent.written()
    for name, limits in (("a", share("0.3", "4Gi")), ("b", share("0.5", "8Gi"))):
        create(kubectl, dra_namespace, node_pod(name, agent.node, limits))
    for name in ("a", "b"):
        wait_running(kubectl, dra_namespace, name, agent)
    placed = [cards_of(kubectl, dra_namespace, name) for name in ("a", "b")]
    assert placed[0] == placed[1]
    assert len(placed[0]) == 1
    charged = sorted(consumed(claim_of(kubectl, dra_namespace, name)) for name in ("a", "b"))
    written = sorted((w.compute_percent, w.memory_bytes) for w in agent.limits(before))
    assert written == charged


def test_a_share_that_fits_no_single_card_waits_pending_and_is_told_why(
    agent: DraAgent, kubectl: Kubectl, dra_namespace: str
) -> None:
    # 0.6 card on each card leaves 0.4 on every one: the node's sum (1.6 cards) would hold 0.5,
    # no single card does.
    fillers = [f"filler-{i}" for i in range(len(CARDS))]
    for name in fillers:
        create(kubectl, dra_namespace, node_pod(name, agent.node, share("0.6", "4Gi")))
    for name in fillers:
        wait_running(kubectl, dra_namespace, name, agent)
    assert len({card for n in fillers for card in cards_of(kubectl, dra_namespace, n)}) == len(
        CARDS
    )
    create(kubectl, dra_namespace, node_pod("wide", agent.node, share("0.5", "4Gi")))
    wait_unschedulable(kubectl, dra_namespace, "wide", agent)
    wait_for(
        lambda: bool(events_of(kubectl, dra_namespace, "wide", REASON)),
        EXPLAINED_WITHIN_S,
        lambda: describe(kubectl, dra_namespace, agent),
    )
    every_claim = json.loads(kubectl.ok("get", "resourceclaims", "-A", "-o", "json"))["items"]
    wide = claim_of(kubectl, dra_namespace, "wide")
    free = free_cards(slices(kubectl, agent.node), every_claim)
    expected = explain(asks_of(wide["spec"]), free)
    messages = [e["message"] for e in events_of(kubectl, dra_namespace, "wide", REASON)]
    assert messages[-1] == expected
    # What a user runs: the same sentence, from the slices and claims as they are now.
    why = kubectl.fracgpu("why", "wide", "-n", dra_namespace, "-o", "json")
    assert why.returncode == 0, why.stderr
    found = json.loads(why.stdout)
    assert (found["state"], found["mode"]) == ("waiting-for-a-card", "dra"), found
    assert found["message"] == f"no card can host it now: {expected}", found
    # Each card with its share, from the claims; and no card can take 0.5 now.
    top = kubectl.fracgpu("top", "--node", agent.node, "-n", dra_namespace, "-o", "json")
    assert top.returncode == 0, top.stderr
    view = json.loads(top.stdout)
    assert view["mode"] == "dra", view
    on_cards = sorted(s["pod"] for c in view["cards"] for s in c["shares"])
    assert on_cards == sorted(fillers), view
    assert [c["free_cores"] for c in view["cards"]] == [40] * len(CARDS), view
    nowhere = kubectl.fracgpu("fit", "0.5", "--gpumem", "4Gi")
    assert nowhere.returncode == 1, nowhere.stdout + nowhere.stderr
    assert "fits nowhere now: largest free share on any node: 0.40 card" in nowhere.stdout
    deadline = time.monotonic() + PENDING_FOR_S
    while time.monotonic() < deadline:
        assert kubectl.get("pod", "wide", dra_namespace)["status"]["phase"] == "Pending"
        time.sleep(1)


def test_the_guard_kills_a_process_over_its_claim(
    agent: DraAgent, kubectl: Kubectl, dra_namespace: str
) -> None:
    """The node guard in DRA mode on the real kubelet: kubelet's PodResources names the pod's
    claim, the claim's limits file is the grant, and a process holding more is killed."""
    create(kubectl, dra_namespace, node_pod("greedy", agent.node, share("0.3", "1Gi")))
    wait_running(kubectl, dra_namespace, "greedy", agent)
    (device,) = cards_of(kubectl, dra_namespace, "greedy")
    card = int(device.split("-")[1])
    guard_kills_over_grant(agent, kubectl, dra_namespace, "greedy", card=card, grant_mib=1024)


def test_top_shows_what_a_claim_uses_on_its_card(
    agent: DraAgent, kubectl: Kubectl, dra_namespace: str
) -> None:
    """`kubectl fracgpu top` shows the share on its card (from the claim) with what its
    process uses now (from the node agent's metrics, through the API server's pod proxy)."""
    create(kubectl, dra_namespace, node_pod("busy", agent.node, share("0.3", "1Gi")))
    wait_running(kubectl, dra_namespace, "busy", agent)
    (device,) = cards_of(kubectl, dra_namespace, "busy")
    top_shows_live_use(agent, kubectl, dra_namespace, "busy", card=int(device.split("-")[1]),
                       label="fracgpu-dra-plugin")  # fmt: skip


def test_whole_cards_are_exclusive(agent: DraAgent, kubectl: Kubectl, dra_namespace: str) -> None:
    whole = [f"whole-{i}" for i in range(len(CARDS) - 1)]
    for name in whole:
        create(kubectl, dra_namespace, node_pod(name, agent.node, share("1")))
    create(kubectl, dra_namespace, node_pod("small", agent.node, share("0.2")))
    for name in [*whole, "small"]:
        wait_running(kubectl, dra_namespace, name, agent)
    held = [card for name in whole for card in cards_of(kubectl, dra_namespace, name)]
    assert len(set(held)) == len(whole)
    assert not set(cards_of(kubectl, dra_namespace, "small")) & set(held)
    create(kubectl, dra_namespace, node_pod("one-more", agent.node, share("1")))
    pod = wait_unschedulable(kubectl, dra_namespace, "one-more", agent)
    assert pod["status"]["phase"] == "Pending"


def test_deleting_pods_frees_their_cards(
    agent: DraAgent, kubectl: Kubectl, dra_namespace: str
) -> None:
    whole = [f"whole-{i}" for i in range(len(CARDS))]
    for name in whole:
        create(kubectl, dra_namespace, node_pod(name, agent.node, share("1")))
    for name in whole:
        wait_running(kubectl, dra_namespace, name, agent)
    create(kubectl, dra_namespace, node_pod("after", agent.node, share("0.5")))
    wait_unschedulable(kubectl, dra_namespace, "after", agent)
    kubectl.ok("delete", "pod", whole[0], "-n", dra_namespace, "--grace-period=0", "--force")
    elapsed = wait_for(
        lambda: (
            (_condition(kubectl.get("pod", "after", dra_namespace), "PodScheduled") or {}).get(
                "status"
            )
            == "True"
        ),
        FREED_WITHIN_S,
        lambda: describe(kubectl, dra_namespace, agent),
    )
    print(f"a 0.5 pod was scheduled {elapsed:.1f}s after a whole-card pod was deleted")
    wait_running(kubectl, dra_namespace, "after", agent)


def test_a_wiped_slice_is_republished(agent: DraAgent, kubectl: Kubectl) -> None:
    """kubelet deletes its node's ResourceSlices when it restarts; the suite cannot restart a
    node's kubelet, so it deletes the slice as kubelet would, and the plugin must put it back."""
    before = device_names(kubectl, agent.node)
    (old,) = slices(kubectl, agent.node)
    kubectl.ok("delete", "resourceslice", old["metadata"]["name"])

    def republished() -> bool:
        uids = [s["metadata"]["uid"] for s in slices(kubectl, agent.node)]
        return bool(uids) and old["metadata"]["uid"] not in uids

    elapsed = wait_for(republished, REPUBLISHED_WITHIN_S, agent.log)
    print(f"the slice was republished {elapsed:.1f}s after it was deleted")
    assert device_names(kubectl, agent.node) == before


def test_plugin_restart_keeps_prepared_claims(
    agent: DraAgent, kubectl: Kubectl, dra_namespace: str
) -> None:
    create(kubectl, dra_namespace, node_pod("before", agent.node, share("0.5")))
    wait_running(kubectl, dra_namespace, "before", agent)
    uid = claim_of(kubectl, dra_namespace, "before")["metadata"]["uid"]
    agent.stop()
    agent.start()
    wait_for(agent.registered, 60, agent.log)
    create(kubectl, dra_namespace, node_pod("after", agent.node, share("0.5")))
    wait_running(kubectl, dra_namespace, "after", agent)
    status = kubectl.get("pod", "before", dra_namespace)["status"]
    assert status["phase"] == "Running"
    assert [c["restartCount"] for c in status["containerStatuses"]] == [0]
    assert uid in agent.cdi_specs()
    assert agent.exited() is None, agent.log()
    kubectl.ok("delete", "pod", "before", "-n", dra_namespace, "--grace-period=0", "--force")
    wait_for(lambda: uid not in agent.cdi_specs(), 60, agent.log)  # unprepared after the restart


def test_a_gpu_quota_counts_claims(agent: DraAgent, kubectl: Kubectl, dra_namespace: str) -> None:
    kubectl.ok("create", "-n", dra_namespace, "-f", "-",
               stdin=manifest(gpu_quota("team", gpu="1")))  # fmt: skip
    create(kubectl, dra_namespace, node_pod("held", agent.node, share("0.5")))
    wait_running(kubectl, dra_namespace, "held", agent)
    assert claim_of(kubectl, dra_namespace, "held")["spec"]["devices"]["requests"]
    refused = kubectl(
        "create", "-n", dra_namespace, "-f", "-",
        stdin=manifest(node_pod("over", agent.node, share("0.6"))),
    )  # fmt: skip
    assert refused.returncode != 0
    assert (
        f'denied the request: GPU quota exceeded in namespace "{dra_namespace}"' in refused.stderr
    )
    assert kubectl("get", "pod", "over", "-n", dra_namespace).returncode != 0


# --- what the real cluster showed and the fakes did not ------------------------------------------

# dra.DEVICE_CLASS_RESOURCE, the implicit extended resource every DeviceClass has (KEP-5004; on by
# default in 1.36, GA in 1.37): left alone, the scheduler makes its claim after admission, where
# no webhook sees it.


def test_the_quota_webhook_sees_the_pod_as_the_mutation_left_it(
    dra_run: Run, kubectl: Kubectl, dra_namespace: str
) -> None:
    """kube-apiserver evaluates a validating webhook's matchConditions on the object after every
    mutating webhook: in DRA mode the pod then names a claim instead of fracgpu.io/ keys, and the
    quota webhook must still be called (the fake API server once evaluated the object before)."""
    kubectl.ok("create", "-n", dra_namespace, "-f", "-",
               stdin=manifest(gpu_quota("small", gpu="0.2")))  # fmt: skip
    refused = kubectl(
        "create", "--dry-run=server", "-n", dra_namespace, "-f", "-",
        stdin=manifest(gpu_pod("over", "0.5")),
    )  # fmt: skip
    assert refused.returncode != 0
    assert 'admission webhook "quota.fracgpu.io' in refused.stderr, refused.stderr


def _class_resource_pod(name: str, node: str, cards: int) -> Obj:
    obj = node_pod(name, node, {})
    obj["spec"]["containers"][0]["resources"] = {"limits": {dra.DEVICE_CLASS_RESOURCE: str(cards)}}
    return obj


def test_without_fracgpu_the_scheduler_claims_a_card_for_the_device_class_resource(
    agent: DraAgent, kubectl: Kubectl
) -> None:
    """What Kubernetes does with the extended resource in a namespace no fracgpu webhook
    selects: the scheduler makes a claim of the class and the pod runs on a fracgpu card. This is
    the way around admission that the webhook closes in its own namespaces (next test)."""
    namespace = f"fracgpu-e2e-plain-{secrets.token_hex(3)}"
    kubectl.ok("create", "namespace", namespace)
    try:
        create(kubectl, namespace, _class_resource_pod("implicit", agent.node, 1))
        wait_running(kubectl, namespace, "implicit", agent)
        status = kubectl.get("pod", "implicit", namespace)["status"]
        made = status["extendedResourceClaimStatus"]["resourceClaimName"]
        claim = kubectl.get("resourceclaim", made, namespace)
        assert [r["driver"] for r in results(claim)] == [dra.DRIVER]
    finally:
        kubectl("delete", "pods", "--all", "-n", namespace, "--grace-period=0", "--force")
        wait_for(lambda: not claims(kubectl, namespace), 60, lambda: f"claims of {namespace}")
        kubectl("delete", "namespace", namespace, "--wait=false")


def test_the_device_class_resource_is_whole_cards_counted_by_the_quota(
    agent: DraAgent, kubectl: Kubectl, dra_namespace: str
) -> None:
    kubectl.ok("create", "-n", dra_namespace, "-f", "-",
               stdin=manifest(gpu_quota("team", gpu="1.5")))  # fmt: skip
    create(kubectl, dra_namespace, _class_resource_pod("one", agent.node, 1))
    wait_running(kubectl, dra_namespace, "one", agent)
    stored = kubectl.get("pod", "one", dra_namespace)
    assert dra.DEVICE_CLASS_RESOURCE not in stored["spec"]["containers"][0]["resources"].get(
        "limits", {}
    )
    assert len(cards_of(kubectl, dra_namespace, "one")) == 1
    refused = kubectl(
        "create", "-n", dra_namespace, "-f", "-",
        stdin=manifest(_class_resource_pod("two", agent.node, 2)),
    )  # fmt: skip
    assert refused.returncode != 0, "two more whole cards were admitted under a 1.5-card GPUQuota"
    assert "GPU quota exceeded" in refused.stderr, refused.stderr


def test_a_share_reaches_its_container_through_cdi_and_nothing_else_does(
    agent: DraAgent, kubectl: Kubectl, dra_namespace: str
) -> None:
    """The runtime (containerd 2 here) applies the claim's CDI spec: looked at from inside the
    container, the hook is preloaded, the limits file is the claim's, the one device node and
    device list entry are the claim's card, and no other card of the node is there."""
    obj = node_pod("inside", agent.node, share("0.3", "4Gi"))
    obj["spec"]["containers"][0].update(image=SHELL_IMAGE, command=["sleep", "3600"])
    create(kubectl, dra_namespace, obj)
    wait_running(kubectl, dra_namespace, "inside", agent)
    claim = claim_of(kubectl, dra_namespace, "inside")
    (device,) = [r["device"] for r in results(claim)]
    card = CARDS[int(device.removeprefix("gpu-"))]
    cores, memory_bytes = consumed(claim)

    def inside(*command: str) -> str:
        return kubectl.ok("exec", "-n", dra_namespace, "inside", "--", *command)

    preload = inside("cat", contract.LD_SO_PRELOAD).split()
    assert preload == [contract.CONTAINER_HOOK_LIBRARY]
    assert inside("ls", contract.CONTAINER_HOOK_LIBRARY).strip() == contract.CONTAINER_HOOK_LIBRARY
    limits = contract.Limits.parse(
        inside("cat", f"{contract.CONTAINER_LIMITS_DIR}/{contract.LIMITS_FILE}")
    )
    assert limits == contract.Limits((card.uuid,), memory_bytes, cores)
    cards_seen = sorted(n for n in inside("ls", "/dev").split() if re.fullmatch(r"nvidia\d+", n))
    assert cards_seen == [f"nvidia{card.minor}"]
    assert inside("ls", contract.DEVICE_LIST_MOUNT_ROOT).split() == [card.uuid]
    env = dict(line.split("=", 1) for line in inside("env").splitlines() if "=" in line)
    assert env[contract.VISIBLE_DEVICES_ENV] == contract.DEVICE_LIST_MOUNT_ROOT
    assert env[ENV_GPU] == "0.3"


def test_a_share_of_two_cards_reaches_its_container_on_two_cards(
    agent: DraAgent, kubectl: Kubectl, dra_namespace: str
) -> None:
    """``fracgpu.io/gpu-count: 2``: the stock scheduler gives the claim's one request two
    distinct cards, each charged the share; inside the container the limits file names both
    cards with the share of each, both device nodes are there, and the variables say 0.3 on 2."""
    limits = {**share("0.3", "4Gi"), "fracgpu.io/gpu-count": "2"}
    obj = node_pod("pair", agent.node, limits)
    obj["spec"]["containers"][0].update(image=SHELL_IMAGE, command=["sleep", "3600"])
    create(kubectl, dra_namespace, obj)
    wait_running(kubectl, dra_namespace, "pair", agent)
    claim = claim_of(kubectl, dra_namespace, "pair")
    (request,) = claim["spec"]["devices"]["requests"]
    assert request["exactly"]["count"] == 2
    devices = sorted(r["device"] for r in results(claim))
    assert len(set(devices)) == 2, devices
    cards = [CARDS[int(d.removeprefix("gpu-"))] for d in devices]
    assert {consumed_of(r) for r in results(claim)} == {(30, 4 << 30)}

    def inside(*command: str) -> str:
        return kubectl.ok("exec", "-n", dra_namespace, "pair", "--", *command)

    limits_file = contract.Limits.parse(
        inside("cat", f"{contract.CONTAINER_LIMITS_DIR}/{contract.LIMITS_FILE}")
    )
    assert (sorted(limits_file.devices), limits_file.memory_bytes, limits_file.compute_percent) == (
        sorted(c.uuid for c in cards), 4 << 30, 30)  # fmt: skip
    seen = sorted(n for n in inside("ls", "/dev").split() if re.fullmatch(r"nvidia\d+", n))
    assert seen == sorted(f"nvidia{c.minor}" for c in cards)
    env = dict(line.split("=", 1) for line in inside("env").splitlines() if "=" in line)
    assert (env[ENV_GPU], env[ENV_GPU_COUNT], env[ENV_MEMORY_MIB]) == ("0.3", "2", "4096")


def test_a_share_of_two_cards_counts_twice_in_a_gpu_quota(
    agent: DraAgent, kubectl: Kubectl, dra_namespace: str
) -> None:
    """0.3 of each of two cards is 0.6 card: a GPUQuota of 0.5 card refuses it, in cards."""
    kubectl.ok("create", "-n", dra_namespace, "-f", "-",
               stdin=manifest(gpu_quota("team", gpu="0.5")))  # fmt: skip
    limits = {**share("0.3", "4Gi"), "fracgpu.io/gpu-count": "2"}
    refused = kubectl(
        "create", "-n", dra_namespace, "-f", "-",
        stdin=manifest(node_pod("pair", agent.node, limits)),
    )  # fmt: skip
    assert refused.returncode != 0, "0.3 on each of two cards was admitted under 0.5 card"
    assert "GPU quota exceeded" in refused.stderr, refused.stderr
    assert "0.60" in refused.stderr, refused.stderr


def test_a_hand_written_claim_for_every_card_is_counted_as_every_card(
    agent: DraAgent, kubectl: Kubectl, dra_namespace: str
) -> None:
    """``allocationMode: All`` takes every matching card of the node (four here): under a
    GPUQuota of 1.5 cards the pod that uses such a claim is refused (it was once counted as one
    card and ran on all four)."""
    kubectl.ok("create", "-n", dra_namespace, "-f", "-",
               stdin=manifest(gpu_quota("team", gpu="1.5")))  # fmt: skip
    claim = {
        "apiVersion": dra.API_VERSION,
        "kind": "ResourceClaim",
        "metadata": {"name": "everything"},
        "spec": {"devices": {"requests": [{"name": "all", "exactly": {
            "deviceClassName": dra.DEVICE_CLASS, "allocationMode": "All"}}]}},
    }  # fmt: skip
    kubectl.ok("create", "-n", dra_namespace, "-f", "-", stdin=manifest(claim))
    obj = node_pod("greedy", agent.node, {})
    obj["spec"]["resourceClaims"] = [{"name": "gpus", "resourceClaimName": "everything"}]
    obj["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpus"}]}
    try:
        refused = kubectl("create", "-n", dra_namespace, "-f", "-", stdin=manifest(obj))
        assert refused.returncode != 0, "a claim of all four cards was admitted under 1.5 cards"
        assert "GPU quota exceeded" in refused.stderr, refused.stderr
    finally:
        # A claim a user wrote outlives its pods: the namespace's clean-up waits for none left.
        kubectl("delete", "pods", "--all", "-n", dra_namespace, "--grace-period=0", "--force")
        kubectl("delete", "resourceclaim", "everything", "-n", dra_namespace)


def _device_class(name: str, expression: str | None, extended: str | None = None) -> Obj:
    spec: Obj = {}
    if expression is not None:
        spec["selectors"] = [{"cel": {"expression": expression}}]
    if extended is not None:
        spec["extendedResourceName"] = extended
    return {"apiVersion": dra.API_VERSION, "kind": "DeviceClass", "metadata": {"name": name},
            "spec": spec}  # fmt: skip


def test_only_fracgpus_device_class_can_reach_its_cards(agent: DraAgent, kubectl: Kubectl) -> None:
    """deploy/overlays/dra's policy, on the real API server (its CEL compiler and cost limits):
    a second class that could select fracgpu's devices, or an explicit extended resource on
    fracgpu's own, is refused with the fix; a class pinned to another driver is not. Server-side
    dry runs only: no class is left behind."""
    policy = [o for o in render(DEPLOY / "overlays" / "dra")
              if o["metadata"]["name"] == "fracgpu-device-classes"]  # fmt: skip
    assert {o["kind"] for o in policy} == {
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
    kubectl.ok("apply", "-f", "-", stdin="---\n".join(manifest(o) for o in policy))

    def dry_run(obj: Obj) -> Any:
        return kubectl("create", "--dry-run=server", "-f", "-", stdin=manifest(obj))

    sneaky = _device_class("e2e-sneaky", f'device.driver == "{dra.DRIVER}"')
    try:
        # A new policy takes effect within seconds (the API server's policy informer).
        wait_for(
            lambda: dry_run(sneaky).returncode != 0, 30, lambda: "the DeviceClass policy in effect"
        )
        refused = dry_run(sneaky)
        assert "could select fracgpu's devices" in refused.stderr, refused.stderr
        refused = dry_run(_device_class("e2e-everything", None))
        assert "could select fracgpu's devices" in refused.stderr, refused.stderr
        widened = _device_class("e2e-widened", 'device.driver == "nic.example.com" || true')
        assert dry_run(widened).returncode != 0
        ours = _device_class(
            dra.DEVICE_CLASS, f'device.driver == "{dra.DRIVER}"', "example.com/gpu"
        )
        refused = kubectl("apply", "--dry-run=server", "-f", "-", stdin=manifest(ours))
        assert "extendedResourceName example.com/gpu is not allowed" in refused.stderr, refused
        nic = _device_class("e2e-nic", 'device.driver == "nic.example.com"', "example.com/nic")
        allowed = dry_run(nic)
        assert allowed.returncode == 0, allowed.stderr
    finally:
        for obj in policy:
            kubectl("delete", obj["kind"], obj["metadata"]["name"], "--ignore-not-found")


def test_the_share_is_shown_in_its_claim_and_its_cards_health_in_the_pod(
    agent: DraAgent, kubectl: Kubectl, dra_namespace: str
) -> None:
    """``kubectl get resourceclaim -o yaml`` shows the share the plugin prepared (its card,
    cores and MiB, Ready, CardHealthy) in status.devices, and kubelet puts the card's health,
    as the plugin's health stream reports it, in the pod's allocatedResourcesStatus (a beta
    feature on by default in 1.36 and 1.37)."""
    create(kubectl, dra_namespace, node_pod("shown", agent.node, share("0.3", "4Gi")))
    wait_running(kubectl, dra_namespace, "shown", agent)
    claim = claim_of(kubectl, dra_namespace, "shown")
    (result,) = results(claim)
    cores, memory = consumed(claim)

    def ours() -> list[Obj]:
        now = kubectl.get("resourceclaim", claim["metadata"]["name"], dra_namespace)
        devices = (now.get("status") or {}).get("devices") or []
        return [d for d in devices if d.get("driver") == dra.DRIVER]

    wait_for(lambda: bool(ours()), 10, lambda: json.dumps(claim.get("status"), indent=1))
    (entry,) = ours()
    key = ("pool", "device", "shareID")
    assert tuple(entry.get(k) for k in key) == tuple(result.get(k) for k in key)
    assert entry["data"]["cores"] == cores
    assert entry["data"]["memoryMiB"] * MIB == memory
    card = CARDS[int(result["device"].rsplit("-", 1)[1])]
    assert entry["data"]["uuid"] == card.uuid
    conditions = {c["type"]: c["status"] for c in entry["conditions"]}
    assert conditions == {"Ready": "True", "CardHealthy": "True"}

    def health() -> list[Obj]:
        pod = kubectl.get("pod", "shown", dra_namespace)
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        found: list[Obj] = []
        for status in statuses:
            found += status.get("allocatedResourcesStatus") or []
        return found

    wait_for(lambda: bool(health()), 60, lambda: json.dumps(health()))
    (claimed,) = health()
    assert claimed["name"].startswith("claim:"), claimed
    (resource,) = claimed["resources"]
    # kubelet names the device by the CDI ID the plugin gave it (one per claim and share).
    assert resource["resourceID"].startswith(f"k8s.{dra.DRIVER}/claim="), resource
    assert claim["metadata"]["uid"] in resource["resourceID"], resource
    assert resource["health"] == "Healthy"


def test_fracgpu_mode_says_dra_here(dra_run: Run, settings: Settings) -> None:
    """``kubectl fracgpu mode`` on this 1.36+ cluster: DRA mode to install, and with the DRA
    overlay's DeviceClass in place, DRA mode admitted by ``admission.allocation: auto``."""
    out = subprocess.run(
        [sys.executable, "-m", "fracgpu.cli", "mode", "--kubeconfig", str(settings.kubeconfig)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("install:   dra mode"), out.stdout
    assert "kubectl apply -k deploy/overlays/dra" in lines[1], out.stdout
    assert lines[2].startswith("admitting: dra mode"), out.stdout


PLUGIN_ACCOUNT = "system:serviceaccount:fracgpu:fracgpu-dra-plugin"


@pytest.mark.parametrize(
    ("question", "allowed"),
    [
        pytest.param(("get", "resourceclaims"), True, id="read-a-claim"),
        pytest.param(("patch", "resourceclaims", "--subresource=status"), True, id="patch-status"),
        pytest.param(("update", "resourceclaims", "--subresource=status"), False, id="no-update"),
        pytest.param(
            ("associated-node:patch", f"resourceclaims/{dra.DRIVER}", "--subresource=driver"),
            True,
            id="its-own-drivers-entries",
        ),
        pytest.param(
            ("associated-node:patch", "resourceclaims/nic.example.com", "--subresource=driver"),
            False,
            id="not-another-drivers",
        ),
        pytest.param(
            ("arbitrary-node:patch", f"resourceclaims/{dra.DRIVER}", "--subresource=driver"),
            False,
            id="not-for-other-nodes",
        ),
    ],
)
def test_the_plugins_role_allows_its_status_writes_and_no_more(
    dra_run: Run, kubectl: Kubectl, question: tuple[str, ...], allowed: bool
) -> None:
    """The DRA overlay's ClusterRole on the real RBAC authorizer (the suite's plugin runs with
    the cluster admin's credentials, so its writes alone would not show the role suffices). RBAC
    names the service account as a subject: the account itself need not exist to be asked about."""
    objs = [o for o in render(DEPLOY / "overlays" / "dra")
            if o["metadata"]["name"] == "fracgpu-dra-plugin"
            and o["kind"] in ("ClusterRole", "ClusterRoleBinding")]  # fmt: skip
    kubectl.ok("apply", "-f", "-", stdin="---\n".join(manifest(o) for o in objs))
    try:
        answer = kubectl("auth", "can-i", *question, "-n", "default", "--as", PLUGIN_ACCOUNT)
        assert answer.stdout.strip() == ("yes" if allowed else "no"), answer
    finally:
        for obj in objs:
            kubectl("delete", obj["kind"], obj["metadata"]["name"], "--ignore-not-found")


CHURN_WAVES = 4
CHURN_SEED = 20261126


def _churn_limits(rng: Any) -> Obj:
    """A share with or without memory, a memory-heavy one, or one or two whole cards."""
    kind = rng.choice(["share", "share", "share-mem", "memory-heavy", "whole", "two"])
    if kind == "share":
        return share(f"0.{rng.randint(1, 7)}")
    if kind == "share-mem":
        return share(f"0.{rng.randint(1, 6)}", f"{rng.choice([2, 4, 6])}Gi")
    if kind == "memory-heavy":
        return share("0.1", f"{rng.choice([12, 16, 20])}Gi")
    return share("1" if kind == "whole" else "2")


def test_churn_leaves_no_pod_failed_and_every_limits_file_its_claims(
    agent: DraAgent, kubectl: Kubectl, dra_namespace: str
) -> None:
    """Waves of shares (with and without memory, memory-heavy), whole cards and two-card pods,
    each created in a burst; half of what exists deleted at random between waves. After every
    wave: no pod Failed, each pod Running or Pending with the scheduler's reason, and every
    running pod's limits file holds exactly what its claim consumed on its card."""
    import random

    rng = random.Random(CHURN_SEED)
    alive: list[str] = []
    for wave in range(CHURN_WAVES):
        names = [f"w{wave}-{i}" for i in range(rng.randint(5, 8))]
        burst = "---\n".join(
            manifest(node_pod(name, agent.node, _churn_limits(rng))) for name in names
        )
        kubectl.ok("create", "-n", dra_namespace, "-f", "-", stdin=burst)
        alive += names

        def current() -> list[Obj]:
            return [
                p for p in pods(kubectl, dra_namespace) if "deletionTimestamp" not in p["metadata"]
            ]

        def settled() -> bool:
            for pod in current():
                phase = pod["status"].get("phase")
                assert phase != "Failed", describe(kubectl, dra_namespace, agent)
                if phase == "Running":
                    continue
                scheduled = _condition(pod, "PodScheduled") or {}
                if scheduled.get("status") != "False" or not scheduled.get("message"):
                    return False
            return True

        wait_for(settled, 90, lambda: describe(kubectl, dra_namespace, agent))
        for pod in current():
            if pod["status"].get("phase") != "Running":
                continue
            claim = claim_of(kubectl, dra_namespace, pod["metadata"]["name"])
            path = agent.host_root / "claims" / claim["metadata"]["uid"] / "limits"
            written = contract.Limits.parse((path / contract.LIMITS_FILE).read_text())
            granted = results(claim)
            cards = sorted(CARDS[int(r["device"].rsplit("-", 1)[1])].uuid for r in granted)
            assert sorted(written.devices) == cards, pod["metadata"]["name"]
            if len(granted) == 1 and "consumedCapacity" in granted[0]:
                assert (written.compute_percent, written.memory_bytes) == consumed(claim)
        gone = rng.sample(alive, len(alive) // 2)
        kubectl.ok("delete", "pods", "-n", dra_namespace, *gone, "--wait=false")
        alive = [n for n in alive if n not in gone]


# Choosing the GPU model in the pod's annotations (issue #28 item 4): the fake cards publish
# productName CARD_PRODUCT; admission selects them by CEL in the claim's template.


def _model_pod(name: str, node: str, annotations: dict[str, str]) -> Obj:
    obj = node_pod(name, node, share("1"))
    obj["metadata"]["annotations"] = annotations
    return obj


def test_a_pod_that_chooses_the_cards_model_gets_a_selector_and_is_allocated(
    agent: DraAgent, kubectl: Kubectl, dra_namespace: str
) -> None:
    annotations = {MODEL_ANNOTATION: CARD_PRODUCT.lower()}  # any case: the slice's spelling
    create(kubectl, dra_namespace, _model_pod("chosen", agent.node, annotations))
    wait_running(kubectl, dra_namespace, "chosen", agent)
    (request,) = claim_of(kubectl, dra_namespace, "chosen")["spec"]["devices"]["requests"]
    expression = dra.products_selector([CARD_PRODUCT])
    assert request["exactly"]["selectors"] == [{"cel": {"expression": expression}}], request
    assert len(cards_of(kubectl, dra_namespace, "chosen")) == 1


@pytest.mark.parametrize(("annotations", "said"), UNHONOURABLE_MODEL_CHOICES)
def test_a_model_choice_fracgpu_cannot_honour_is_denied_at_create_in_dra_mode(
    agent: DraAgent,
    kubectl: Kubectl,
    dra_namespace: str,
    annotations: dict[str, str],
    said: str,
) -> None:
    """The models are the slices' (the agent's): a dry run waits until the webhook has seen them,
    then the create is refused with the message."""
    stdin = manifest(_model_pod("denied", agent.node, annotations))

    def refused() -> bool:
        proc = kubectl("create", "--dry-run=server", "-n", dra_namespace, "-f", "-", stdin=stdin)
        return proc.returncode != 0 and said in proc.stderr

    wait_for(refused, 15, lambda: describe(kubectl, dra_namespace, agent))
    proc = kubectl("create", "-n", dra_namespace, "-f", "-", stdin=stdin)
    assert proc.returncode != 0
    assert said in proc.stderr, proc.stderr
    assert f"known: {CARD_PRODUCT}" in proc.stderr, proc.stderr
    assert kubectl("get", "pod", "denied", "-n", dra_namespace).returncode != 0


def test_a_share_that_may_burst_is_lent_idle_compute_and_a_hard_cap_is_not(
    agent: DraAgent, kubectl: Kubectl, dra_namespace: str
) -> None:
    """DRA mode: the policy read from the claim's configuration at prepare; the usage file
    written where the hook reads it."""
    a_burst_is_lent_idle_compute_and_a_cap_is_not(agent, kubectl, dra_namespace)
