"""What a user sees with kubectl on a real cluster with fracgpu's webhook configurations.

The webhook runs locally (harness.LocalWebhook) and the API server calls it by URL, so this runs
against clusters without GPU nodes and even without kubelets: pods stay Pending, which is enough
to see what admission did. Expected objects and messages come from the webhook's own code.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from core.units import CANONICAL, REQUEST_ANNOTATION
from tests.e2e.harness import Kubectl, LocalWebhook
from tests.e2e.scenarios import deployment, expected, gpu_pod, manifest, plain_pod

MUTATE = "mutate.fracgpu.io"
GPU_FIELDS = ("schedulerName", "tolerations")


def _container_view(c: dict[str, Any]) -> dict[str, Any]:
    """The parts of a container the webhook owns; the API server's defaults are left out."""
    resources = c.get("resources", {})
    gpu = {
        part: {k: str(v) for k, v in resources.get(part, {}).items() if k in CANONICAL}
        for part in ("limits", "requests")
    }
    env = {e["name"]: e.get("value") for e in c.get("env", []) if e["name"].startswith("FRACGPU_")}
    return {"name": c["name"], "resources": gpu, "env": env}


def assert_admitted_like_the_code(stored_spec: dict[str, Any], want_spec: dict[str, Any]) -> None:
    for field in GPU_FIELDS:
        want = want_spec.get(field)
        got = stored_spec.get(field)
        if field == "tolerations":
            assert want and all(t in got for t in want), f"tolerations: {got} lacks {want}"
        else:
            assert got == want, f"{field}: {got!r} != {want!r}"
    got_c = [_container_view(c) for c in stored_spec["containers"]]
    want_c = [_container_view(c) for c in want_spec["containers"]]
    assert got_c == want_c


def test_fractional_pod_is_rewritten_to_the_canonical_form(
    kubectl: Kubectl, namespace: str
) -> None:
    pod = gpu_pod("frac", "0.3", "4096")
    outcome, want = expected(pod)
    assert outcome.allowed and outcome.gpu
    kubectl.ok("create", "-n", namespace, "-f", "-", stdin=manifest(pod))
    stored = kubectl.get("pod", "frac", namespace)
    assert_admitted_like_the_code(stored["spec"], want["spec"])
    limits = stored["spec"]["containers"][0]["resources"]["limits"]
    assert "fracgpu.io/gpu" not in limits and "fracgpu.io/gpumem" not in limits
    annotation = json.loads(stored["metadata"]["annotations"][REQUEST_ANNOTATION])
    assert annotation == {"main": {"fracgpu.io/gpu": "0.3", "fracgpu.io/gpumem": "4096"}}


def test_server_side_dry_run_is_mutated_and_stores_nothing(
    kubectl: Kubectl, namespace: str
) -> None:
    pod = gpu_pod("dry", "0.5")
    _, want = expected(pod)
    out = kubectl.ok(
        "create", "--dry-run=server", "-o", "json", "-n", namespace, "-f", "-", stdin=manifest(pod)
    )
    assert_admitted_like_the_code(json.loads(out)["spec"], want["spec"])
    assert kubectl("get", "pod", "dry", "-n", namespace).returncode != 0


def test_deployment_with_half_a_card_is_accepted_and_its_pods_are_canonical(
    kubectl: Kubectl, namespace: str
) -> None:
    obj = deployment("half", "0.5")
    outcome, want = expected(obj)
    assert outcome.allowed and outcome.gpu
    kubectl.ok("apply", "-n", namespace, "-f", "-", stdin=manifest(obj))
    stored = kubectl.get("deployment", "half", namespace)
    template = want["spec"]["template"]["spec"]
    assert_admitted_like_the_code(stored["spec"]["template"]["spec"], template)

    # The ReplicaSet controller makes the pod; it stays Pending where no node has GPUs.
    deadline = time.monotonic() + 90
    pods: list[dict[str, Any]] = []
    while time.monotonic() < deadline and not pods:
        listing = json.loads(
            kubectl.ok("get", "pods", "-n", namespace, "-l", "app=half", "-o", "json")
        )
        pods = listing["items"]
        time.sleep(1)
    assert pods, "no pod was created for the Deployment in 90s: is kube-controller-manager running?"
    assert_admitted_like_the_code(pods[0]["spec"], template)


def test_invalid_request_is_denied_with_the_documented_message(
    kubectl: Kubectl, namespace: str, tmp_path: Path
) -> None:
    pod = gpu_pod("invalid", "1.5")
    outcome, _ = expected(pod)
    assert not outcome.allowed
    path = tmp_path / "pod.yaml"
    path.write_text(manifest(pod))
    proc = kubectl("create", "-n", namespace, "-f", str(path))
    assert proc.returncode != 0
    assert proc.stderr.strip() == (
        f'Error from server (Invalid): error when creating "{path}": admission webhook '
        f'"{MUTATE}" denied the request: {outcome.message}'
    )
    assert kubectl("get", "pod", "invalid", "-n", namespace).returncode != 0


def test_with_the_webhook_down_only_gpu_pods_are_refused(
    kubectl: Kubectl, namespace: str, webhook: LocalWebhook
) -> None:
    webhook.stop()
    try:
        plain = kubectl("create", "-n", namespace, "-f", "-", stdin=manifest(plain_pod("plain")))
        assert plain.returncode == 0, f"a pod without a GPU was refused: {plain.stderr}"
        gpu = kubectl("create", "-n", namespace, "-f", "-", stdin=manifest(gpu_pod("gpu", "0.2")))
        assert gpu.returncode != 0, "a GPU pod was admitted without the webhook"
        assert f'failed calling webhook "{MUTATE}"' in gpu.stderr, gpu.stderr
        assert "Error from server (InternalError)" in gpu.stderr, gpu.stderr
    finally:
        webhook.start()
    assert kubectl("get", "pod", "gpu", "-n", namespace).returncode != 0


def test_workloads_without_a_gpu_pass_untouched(kubectl: Kubectl, namespace: str) -> None:
    obj = deployment("cpu-only", "0.1")
    obj["spec"]["template"]["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "100m"}}
    kubectl.ok("apply", "-n", namespace, "-f", "-", stdin=manifest(obj))
    template = kubectl.get("deployment", "cpu-only", namespace)["spec"]["template"]
    assert template["spec"].get("schedulerName", "default-scheduler") == "default-scheduler"
    assert REQUEST_ANNOTATION not in (template["metadata"].get("annotations") or {})
    limits = template["spec"]["containers"][0]["resources"]["limits"]
    assert not any(k.startswith("fracgpu.io/") for k in limits)
