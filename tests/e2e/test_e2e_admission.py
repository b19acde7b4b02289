"""What a user sees with kubectl on a real cluster with fracgpu's webhook configurations.

The webhook runs locally (harness.LocalWebhook) and the API server calls it by URL, so this runs
against clusters without GPU nodes: pods stay Pending (a nodeSelector nothing matches), which is
enough to see what admission did. Expected objects and messages come from the webhook's own code
with the configuration the local webhook was given; kubectl's own prefix ("Error from server
(Invalid): ..." before 1.36, "The request is invalid: ..." since) is not pinned.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from core.units import CANONICAL, CORE, DOMAIN, REQUEST_ANNOTATION
from tests.e2e.harness import Kubectl, LocalWebhook, Run
from tests.e2e.scenarios import deployment, expected, gpu_pod, manifest, plain_pod, pod

Obj = dict[str, Any]
DEFAULT_SCHEDULER = "default-scheduler"  # what the API server sets when nobody else does


def webhook_name(run: Run, kind: str) -> str:
    (obj,) = [o for o in run.configurations if o["kind"] == kind]
    name: str = obj["webhooks"][0]["name"]
    return name


def _canonical(resources: Obj, part: str) -> dict[str, str]:
    return {k: str(v) for k, v in (resources.get(part) or {}).items() if k in CANONICAL}


def _container_view(c: Obj, *, defaulted: bool) -> Obj:
    """The parts of a container the webhook owns. ``defaulted``: as the API server stores it,
    with requests copied from limits where unset (extended resources cannot overcommit)."""
    resources = c.get("resources") or {}
    limits = _canonical(resources, "limits")
    requests = _canonical(resources, "requests")
    if defaulted:
        requests = {**limits, **requests}
    env = {e["name"]: e.get("value") for e in c.get("env", []) if e["name"].startswith("FRACGPU_")}
    return {"name": c["name"], "limits": limits, "requests": requests, "env": env}


def _ours(meta: Obj) -> dict[str, str]:
    return {k: v for k, v in (meta.get("annotations") or {}).items() if k.startswith(f"{DOMAIN}/")}


def assert_admitted_like_the_code(stored: Obj, want: Obj) -> None:
    """``stored`` (a pod or pod template as the API server keeps it) is what the webhook's own
    code makes of the object: canonical resources, env, scheduler, tolerations, annotations."""
    spec, want_spec = stored["spec"], want["spec"]
    assert spec.get("schedulerName") == want_spec.get("schedulerName", DEFAULT_SCHEDULER)
    for toleration in want_spec.get("tolerations") or []:
        assert toleration in (spec.get("tolerations") or []), toleration
    got = [_container_view(c, defaulted=False) for c in spec["containers"]]
    assert got == [_container_view(c, defaulted=True) for c in want_spec["containers"]]
    assert _ours(stored["metadata"]) == _ours(want["metadata"])


GPU_PODS = [
    pytest.param({"fracgpu.io/gpu": "0.3", "fracgpu.io/gpumem": "4096"}, id="fraction-and-mib"),
    pytest.param({"fracgpu.io/gpu": "0.25"}, id="fraction-only"),
    pytest.param({"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem-percentage": "50"}, id="percentage"),
    pytest.param({"fracgpu.io/gpumem": "8Gi"}, id="memory-only"),
    pytest.param({"fracgpu.io/gpu": "1"}, id="one-whole-card"),
    pytest.param({"fracgpu.io/gpu": "2"}, id="two-whole-cards"),
]


@pytest.mark.parametrize("limits", GPU_PODS)
def test_gpu_pod_is_stored_in_the_canonical_form(
    kubectl: Kubectl, namespace: str, limits: Obj
) -> None:
    obj = pod("gpu", limits)
    outcome, want = expected(obj)
    assert outcome.allowed, outcome.message
    kubectl.ok("create", "-n", namespace, "-f", "-", stdin=manifest(obj))
    stored = kubectl.get("pod", "gpu", namespace)
    assert_admitted_like_the_code(stored, want)


@pytest.mark.parametrize("cards", ["1", "2"])
def test_whole_cards_are_stored_with_core_alone(
    kubectl: Kubectl, namespace: str, cards: str
) -> None:
    """A whole card is all of the card: its pod carries fracgpu.io/core and no memory resource
    (a scenario once expected fracgpu.io/memory there, and only the real cluster said no)."""
    kubectl.ok("create", "-n", namespace, "-f", "-", stdin=manifest(gpu_pod("whole", cards)))
    limits = kubectl.get("pod", "whole", namespace)["spec"]["containers"][0]["resources"]["limits"]
    assert sorted(k for k in limits if k.startswith(f"{DOMAIN}/")) == [CORE]
    assert limits[CORE] == str(100 * int(cards))


def test_the_users_request_is_kept_beside_the_canonical_resources(
    kubectl: Kubectl, namespace: str
) -> None:
    """What the user wrote stays readable on the pod (kubectl get pod -o yaml)."""
    kubectl.ok("create", "-n", namespace, "-f", "-", stdin=manifest(gpu_pod("frac", "0.3", "4096")))
    stored = kubectl.get("pod", "frac", namespace)
    limits = stored["spec"]["containers"][0]["resources"]["limits"]
    asked = json.loads(stored["metadata"]["annotations"][REQUEST_ANNOTATION])
    assert sorted(k for k in limits if k.startswith(f"{DOMAIN}/")) == sorted(CANONICAL)
    assert asked == {"main": {"fracgpu.io/gpu": "0.3", "fracgpu.io/gpumem": "4096"}}


def test_server_side_dry_run_is_mutated_and_stores_nothing(
    kubectl: Kubectl, namespace: str
) -> None:
    obj = gpu_pod("dry", "0.5")
    _, want = expected(obj)
    out = kubectl.ok(
        "create", "--dry-run=server", "-o", "json", "-n", namespace, "-f", "-", stdin=manifest(obj)
    )
    assert_admitted_like_the_code(json.loads(out), want)
    assert kubectl("get", "pod", "dry", "-n", namespace).returncode != 0


def _pods_of(kubectl: Kubectl, namespace: str, app: str, within_s: float) -> list[Obj]:
    deadline = time.monotonic() + within_s
    while True:
        listing = json.loads(
            kubectl.ok("get", "pods", "-n", namespace, "-l", f"app={app}", "-o", "json")
        )
        items: list[Obj] = listing["items"]
        if items or time.monotonic() > deadline:
            return items
        time.sleep(1)


def test_deployment_with_half_a_card_is_accepted_and_its_pods_are_canonical(
    kubectl: Kubectl, namespace: str
) -> None:
    obj = deployment("half", {"fracgpu.io/gpu": "0.5"})
    outcome, want = expected(obj)
    assert outcome.allowed, outcome.message
    kubectl.ok("apply", "-n", namespace, "-f", "-", stdin=manifest(obj))
    stored = kubectl.get("deployment", "half", namespace)
    assert_admitted_like_the_code(stored["spec"]["template"], want["spec"]["template"])
    # The ReplicaSet controller makes the pod, through the webhooks again.
    pods = _pods_of(kubectl, namespace, "half", within_s=90)
    assert pods, "no pod was created for the Deployment in 90s: is kube-controller-manager running?"
    assert_admitted_like_the_code(pods[0], want["spec"]["template"])


DENIED = [
    pytest.param({"fracgpu.io/gpu": "1.5"}, id="fraction-above-one"),
    pytest.param({"fracgpu.io/gpu": "0.333"}, id="three-decimals"),
    pytest.param({"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem-percentage": "150"}, id="pct-150"),
    # Device-plugin mode cannot give a share of several cards: denied at once, saying DRA can.
    pytest.param(
        {"fracgpu.io/gpu": "0.3", "fracgpu.io/gpu-count": "2"}, id="share-of-two-cards-needs-dra"
    ),
]


@pytest.mark.parametrize("limits", DENIED)
def test_invalid_request_is_denied_with_the_webhooks_message(
    e2e: Run, kubectl: Kubectl, namespace: str, tmp_path: Path, limits: Obj
) -> None:
    obj = pod("invalid", limits)
    outcome, _ = expected(obj)
    assert not outcome.allowed
    path = tmp_path / "pod.yaml"
    path.write_text(manifest(obj))
    proc = kubectl("create", "-n", namespace, "-f", str(path))
    assert proc.returncode != 0
    name = webhook_name(e2e, "MutatingWebhookConfiguration")
    assert f'admission webhook "{name}" denied the request: {outcome.message}' in proc.stderr
    assert kubectl("get", "pod", "invalid", "-n", namespace).returncode != 0


def test_with_the_webhook_down_only_gpu_objects_are_refused(
    e2e: Run, kubectl: Kubectl, namespace: str, webhook: LocalWebhook
) -> None:
    name = webhook_name(e2e, "MutatingWebhookConfiguration")
    cpu_only = deployment("cpu-only", {"cpu": "100m"})
    webhook.stop()
    try:
        plain = kubectl("create", "-n", namespace, "-f", "-", stdin=manifest(plain_pod("plain")))
        workload = kubectl("create", "-n", namespace, "-f", "-", stdin=manifest(cpu_only))
        gpu = kubectl("create", "-n", namespace, "-f", "-", stdin=manifest(gpu_pod("gpu", "0.2")))
    finally:
        webhook.start()
    assert plain.returncode == 0, f"a pod without a GPU was refused: {plain.stderr}"
    assert workload.returncode == 0, f"a Deployment without a GPU was refused: {workload.stderr}"
    assert gpu.returncode != 0, "a GPU pod was admitted without the webhook"
    assert f'failed calling webhook "{name}"' in gpu.stderr
    assert kubectl("get", "pod", "gpu", "-n", namespace).returncode != 0
    again = kubectl("create", "-n", namespace, "-f", "-", stdin=manifest(gpu_pod("gpu", "0.2")))
    assert again.returncode == 0, f"the restarted webhook refused a GPU pod: {again.stderr}"


def test_workloads_without_a_gpu_pass_untouched(kubectl: Kubectl, namespace: str) -> None:
    obj = deployment("cpu-only", {"cpu": "100m"})
    kubectl.ok("apply", "-n", namespace, "-f", "-", stdin=manifest(obj))
    template = kubectl.get("deployment", "cpu-only", namespace)["spec"]["template"]
    assert template["spec"].get("schedulerName", DEFAULT_SCHEDULER) == DEFAULT_SCHEDULER
    assert _ours(template["metadata"]) == {}
    limits = template["spec"]["containers"][0]["resources"]["limits"]
    assert [k for k in limits if k.startswith(f"{DOMAIN}/")] == []
