"""The Helm chart on the real cluster: `helm install`, `helm upgrade` and `helm uninstall` through
the real API server, which creates, changes and removes every object (it compiles the policies'
and webhook configurations' CEL, checks RBAC escalation and the schemas).

Mode auto is decided by Helm from what this API server serves: DRA on 1.36 and 1.37. The
workloads' pods do not run here (the release names an image the cluster does not hold): this
test is about the objects; test_e2e_release.py runs the release with fracgpu's image.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import subprocess
from pathlib import Path
from typing import Any

import yaml

from core.kube import NAMESPACES, KubeNotFound, call_json
from tests.deploy_render import CHART, helm
from tests.e2e.harness import Settings

Obj = dict[str, Any]

# Where each kind is read, to check that it exists (or is gone).
PATHS = {
    "ConfigMap": "/api/v1/namespaces/{ns}/configmaps/{name}",
    "Secret": "/api/v1/namespaces/{ns}/secrets/{name}",
    "Service": "/api/v1/namespaces/{ns}/services/{name}",
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts/{name}",
    "Deployment": "/apis/apps/v1/namespaces/{ns}/deployments/{name}",
    "DaemonSet": "/apis/apps/v1/namespaces/{ns}/daemonsets/{name}",
    "PodDisruptionBudget": "/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets/{name}",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles/{name}",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings/{name}",
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles/{name}",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{name}",
    "MutatingWebhookConfiguration": (
        "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{name}"
    ),
    "ValidatingWebhookConfiguration": (
        "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{name}"
    ),
    "ValidatingAdmissionPolicy": (
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/{name}"
    ),
    "ValidatingAdmissionPolicyBinding": (
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings/{name}"
    ),
    "DeviceClass": "/apis/resource.k8s.io/v1/deviceclasses/{name}",
}


class Helm:
    def __init__(self, kubeconfig: Path, release: str, namespace: str) -> None:
        self.base = [helm(), "--kubeconfig", str(kubeconfig), "--namespace", namespace]
        self.release = release

    def __call__(self, *args: str) -> str:
        proc = subprocess.run(
            [*self.base, *args], capture_output=True, text=True, timeout=180, check=False
        )
        assert proc.returncode == 0, f"helm {' '.join(args)} failed:\n{proc.stderr}"
        return proc.stdout

    def manifest(self) -> list[Obj]:
        text = self("get", "manifest", self.release)
        return [doc for doc in yaml.safe_load_all(text) if doc]

    def values(self, *pairs: str) -> list[str]:
        return [arg for pair in pairs for arg in ("--set-json", pair)]


async def _exists(api: Any, obj: Obj, namespace: str) -> Obj | None:
    meta = obj["metadata"]
    path = PATHS[obj["kind"]].format(ns=meta.get("namespace", namespace), name=meta["name"])
    try:
        found: Obj = await call_json(api, "GET", path)
    except KubeNotFound:
        return None
    return found


def _names(objs: list[Obj], kind: str) -> set[str]:
    return {o["metadata"]["name"] for o in objs if o["kind"] == kind}


async def test_install_upgrade_and_uninstall(settings: Settings, kube_api: Any) -> None:
    namespace = f"fracgpu-e2e-helm-{secrets.token_hex(3)}"
    release = "fracgpu"
    run = Helm(settings.kubeconfig, release, namespace)
    installed: list[Obj] = []
    upgraded: list[Obj] = []
    # The run's own webhooks may be registered meanwhile; this release's are not called: no GPU
    # pod is created while it is installed.
    try:
        # auto, at install, decides from what this API server serves: resource.k8s.io/v1 on
        # 1.36 or newer, DRA mode (what `helm install` would do, without doing it).
        dry_run = ("--create-namespace", "--dry-run=server", "-o", "json")
        planned = json.loads(await asyncio.to_thread(run, "install", release, str(CHART), *dry_run))
        plan = [doc for doc in yaml.safe_load_all(planned["manifest"]) if doc]
        assert _names(plan, "DaemonSet") == {"fracgpu-dra-plugin"}
        assert _names(plan, "DeviceClass") == {"gpu.fracgpu.io"}

        await asyncio.to_thread(
            run, "install", release, str(CHART), "--create-namespace",
            *run.values('mode="device-plugin"', 'webhook={"replicas": 1}'),
        )  # fmt: skip
        installed = await asyncio.to_thread(run.manifest)
        kinds = {o["kind"] for o in installed}
        assert set(PATHS) >= kinds, f"kinds this test cannot read: {kinds - set(PATHS)}"
        for obj in installed:
            assert await _exists(kube_api, obj, namespace), f"{obj['kind']} {obj['metadata']}"
        assert _names(installed, "DaemonSet") == {"fracgpu-device-plugin"}
        assert "PodDisruptionBudget" not in kinds  # one replica
        config = yaml.safe_load(
            next(o for o in installed if o["metadata"]["name"] == "fracgpu-config")["data"][
                "config.yaml"
            ]
        )
        assert config["certs"]["namespace"] == namespace

        # What the webhook writes at run time (certs mode "self"): its certificates into the
        # Secret the chart created empty, its CA into the webhook configurations. An upgrade
        # must leave both alone, or every replica would have to issue again.
        secret_path = PATHS["Secret"].format(ns=namespace, name="fracgpu-webhook-tls")
        issued = {"tls.crt": "Y2VydA==", "tls.key": "a2V5", "ca.crt": "Y2E="}
        await call_json(
            kube_api, "PATCH", secret_path, body={"data": issued},
            content_type="application/merge-patch+json",
        )  # fmt: skip
        mutate_path = PATHS["MutatingWebhookConfiguration"].format(name="fracgpu-mutate")
        mutate = await call_json(kube_api, "GET", mutate_path)
        mutate["webhooks"][0]["clientConfig"]["caBundle"] = "Y2E="
        await call_json(kube_api, "PUT", mutate_path, body=mutate)

        # Upgrade with mode auto, two replicas, a setting of fracgpu serve: the release keeps
        # its node agent (auto would pick DRA on this cluster, under running device-plugin
        # shares), and takes the rest.
        await asyncio.to_thread(
            run, "upgrade", release, str(CHART), "--reuse-values",
            *run.values(
                'mode="auto"', 'webhook={"replicas": 2}',
                'config={"quota": {"require_quota": true}}',
            ),
        )  # fmt: skip
        upgraded = await asyncio.to_thread(run.manifest)
        for obj in upgraded:
            assert await _exists(kube_api, obj, namespace), f"{obj['kind']} {obj['metadata']}"
        assert _names(upgraded, "DaemonSet") == {"fracgpu-device-plugin"}
        deployment = await call_json(
            kube_api, "GET", PATHS["Deployment"].format(ns=namespace, name="fracgpu-webhook")
        )
        assert deployment["spec"]["replicas"] == 2
        live = await call_json(
            kube_api, "GET", PATHS["ConfigMap"].format(ns=namespace, name="fracgpu-config")
        )
        config = yaml.safe_load(live["data"]["config.yaml"])
        assert config["quota"]["require_quota"] is True
        assert "allocation" not in config["admission"]
        assert (await call_json(kube_api, "GET", secret_path))["data"] == issued
        mutate = await call_json(kube_api, "GET", mutate_path)
        assert mutate["webhooks"][0]["clientConfig"]["caBundle"] == "Y2E="

        # Naming the mode switches it: the device plugin's objects go, DRA mode's come.
        await asyncio.to_thread(
            run, "upgrade", release, str(CHART), "--reuse-values", *run.values('mode="dra"')
        )
        switched = await asyncio.to_thread(run.manifest)
        for obj in switched:
            assert await _exists(kube_api, obj, namespace), f"{obj['kind']} {obj['metadata']}"
        for gone in [o for o in upgraded if o["kind"] == "DaemonSet"]:
            assert await _exists(kube_api, gone, namespace) is None, gone["metadata"]
        assert _names(switched, "DaemonSet") == {"fracgpu-dra-plugin"}
        live = await call_json(
            kube_api, "GET", PATHS["ConfigMap"].format(ns=namespace, name="fracgpu-config")
        )
        assert yaml.safe_load(live["data"]["config.yaml"])["admission"]["allocation"] == "dra"
        upgraded += switched
        history = json.loads(await asyncio.to_thread(run, "history", release, "-o", "json"))
        assert [h["status"] for h in history] == ["superseded", "superseded", "deployed"]

        # --no-hooks: the post-delete node cleanup would run fracgpu's image, which this test's
        # release does not name (test_e2e_release.py uninstalls with it).
        await asyncio.to_thread(run, "uninstall", release, "--wait", "--no-hooks")
        # Nothing of the release is left, least of all a fail-closed webhook configuration
        # that would deny GPU pods with no webhook to answer.
        for obj in upgraded + installed:
            left = await _exists(kube_api, obj, namespace)
            assert left is None, f"{obj['kind']} {obj['metadata']} outlived the uninstall"
    finally:
        with contextlib.suppress(AssertionError):
            await asyncio.to_thread(
                run, "uninstall", release, "--wait", "--ignore-not-found", "--no-hooks"
            )
        with contextlib.suppress(KubeNotFound):
            await call_json(kube_api, "DELETE", NAMESPACES.path(name=namespace))
