"""deploy/: every overlay renders, validates against the Kubernetes schemas of every supported
version, and carries what the install promises (HA webhook, hardened pods, the scheduler profile,
configuration the webhook accepts, the same configuration in every overlay)."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest

from core import contract
from core.units import CANONICAL
from tests.deploy_render import (
    DEPLOY,
    NAMESPACE,
    OVERLAYS,
    Obj,
    config_of,
    find,
    of_kind,
    pod_specs,
    render,
)
from webhook.config import SCHEDULER_PROFILE, AdmissionConfig, ServerConfig

# Kubernetes minor versions fracgpu supports: matchConditions are GA from 1.30. The newest is the
# newest schema set that the pinned kubernetes-validate ships.
SUPPORTED_VERSIONS = tuple(f"1.{minor}.0" for minor in range(30, 38))
# Kinds that are not built into Kubernetes; kubernetes-validate has no schema for them, so they are
# checked by the tests that read them (cert-manager's are checked below for what we rely on).
CUSTOM_KINDS = frozenset({"cert-manager.io/v1/Certificate", "cert-manager.io/v1/Issuer"})
CLUSTER_SCOPED = frozenset(
    {
        "Namespace",
        "ClusterRole",
        "ClusterRoleBinding",
        "MutatingWebhookConfiguration",
        "ValidatingWebhookConfiguration",
        "CustomResourceDefinition",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_into_namespace_fracgpu(overlay: str) -> None:
    objs = render(overlay)
    assert find(objs, "Namespace", NAMESPACE)
    for obj in objs:
        ns = obj["metadata"].get("namespace")
        where = f"{obj['kind']} {obj['metadata']['name']}"
        if obj["kind"] in CLUSTER_SCOPED:
            assert ns is None, f"{where} is cluster-scoped but names namespace {ns}"
        elif obj["kind"] == "RoleBinding" and obj["metadata"]["name"].endswith(
            "authentication-reader"
        ):
            assert ns == "kube-system", f"{where} must live next to its Role in kube-system"
        else:
            assert ns == NAMESPACE, f"{where} is in namespace {ns!r}, not {NAMESPACE!r}"


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schema(overlay: str, version: str) -> None:
    checked = 0
    for obj in render(overlay):
        if f"{obj['apiVersion']}/{obj['kind']}" in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{overlay}: {obj['kind']} {obj['metadata']['name']} is invalid for "
                f"Kubernetes {version}: {exc.message} at {list(exc.path)}"
            )
        checked += 1
    assert checked >= 20


def test_the_schema_check_rejects_what_kubernetes_rejects() -> None:
    """Guards the test above: strict validation must catch a misspelt field and a wrong type."""
    objs = render("default")
    deployment = copy.deepcopy(find(objs, "Deployment", "fracgpu-webhook"))
    deployment["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, SUPPORTED_VERSIONS[0], strict=True)
    mwc = copy.deepcopy(find(objs, "MutatingWebhookConfiguration", "fracgpu-mutate"))
    mwc["webhooks"][0]["timeoutSeconds"] = "5"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(mwc, SUPPORTED_VERSIONS[0], strict=True)


def test_the_crds_are_installed_with_every_overlay() -> None:
    crd_file = DEPLOY / "crds" / "gpuquota.yaml"
    if not crd_file.exists():
        pytest.skip("deploy/crds/gpuquota.yaml is not in this tree yet (branch quota ships it)")
    for overlay in OVERLAYS:
        crds = of_kind(render(overlay), "CustomResourceDefinition")
        names = sorted(c["metadata"]["name"] for c in crds)
        assert names == ["gpunodeledgers.fracgpu.io", "gpuquotas.fracgpu.io"], (
            f"{overlay}: add ../crds to deploy/base/kustomization.yaml resources"
        )


def _webhook(objs: list[Obj]) -> tuple[Obj, Obj]:
    deployment = find(objs, "Deployment", "fracgpu-webhook")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return deployment, container


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_webhook_is_highly_available(overlay: str) -> None:
    objs = render(overlay)
    deployment, _ = _webhook(objs)
    spec = deployment["spec"]
    assert spec["replicas"] >= 2
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    labels = spec["template"]["metadata"]["labels"]
    pdb = find(objs, "PodDisruptionBudget", "fracgpu-webhook")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["minAvailable"] >= 1
    assert pdb["spec"]["minAvailable"] < spec["replicas"], "the PDB would block every drain"
    spread = spec["template"]["spec"]["topologySpreadConstraints"]
    by_host = [c for c in spread if c["topologyKey"] == "kubernetes.io/hostname"]
    assert by_host
    assert by_host[0]["whenUnsatisfiable"] == "DoNotSchedule"
    assert by_host[0]["labelSelector"]["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_replicas_know_their_pod_address_to_decide_quota_for_the_others(overlay: str) -> None:
    """The replica that leads the quota controller advertises https://$POD_IP:<port> so the
    others send it their decisions (one writer per GPUQuota); the port is the server's."""
    _, container = _webhook(render(overlay))
    env = {e["name"]: e for e in container.get("env") or []}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert any(p["containerPort"] == 8443 for p in container["ports"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_is_hardened_and_bounded(overlay: str) -> None:
    for workload, spec in pod_specs(render(overlay)):
        name = workload["metadata"]["name"]
        pod_sc = spec.get("securityContext", {})
        assert pod_sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", name
        for container in spec.get("initContainers", []) + spec["containers"]:
            where = f"{name}/{container['name']}"
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["readOnlyRootFilesystem"] is True, where
            # the node guard kills processes of other users' containers (guard.py)
            added = ["KILL"] if where == "fracgpu-device-plugin/device-plugin" else []
            assert sc["capabilities"] == {"drop": ["ALL"], **({"add": added} if added else {})}, (
                where
            )
            assert not sc.get("privileged", False), where
            res = container["resources"]
            assert {"cpu", "memory"} <= res["requests"].keys(), where
            assert "memory" in res["limits"], where
        if workload["kind"] == "Deployment":
            assert pod_sc["runAsNonRoot"] is True, name
            assert pod_sc["runAsUser"] != 0, name


def test_only_the_device_plugin_runs_as_root_mounts_host_paths_and_shares_host_pids() -> None:
    for workload, spec in pod_specs(render("default")):
        host_paths = [v for v in spec.get("volumes", []) if "hostPath" in v]
        if workload["metadata"]["name"] == "fracgpu-device-plugin":
            assert {v["hostPath"]["path"] for v in host_paths} == {
                "/var/lib/kubelet/device-plugins",
                "/var/lib/kubelet/pod-resources",
                contract.HOST_ROOT,
                "/var/run/cdi",
                "/var/log/containers",
                "/etc/nvidia-container-runtime",  # read by check-nvidia-toolkit
                contract.DEVICE_LIST_HOST_PATH,  # the plugin's own device list: all cards
            }
            assert spec["hostPID"] is True  # the node guard reads and kills node pids
        else:
            assert host_paths == [], workload["metadata"]["name"]
            assert "hostPID" not in spec, workload["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_webhook_config_is_accepted_by_the_webhook(overlay: str) -> None:
    config = config_of(render(overlay))
    assert ServerConfig.model_validate(config["server"]) == ServerConfig()
    admission = AdmissionConfig.model_validate(config["admission"])
    if overlay == "node-placement":
        assert "extender" not in config
        assert admission.scheduler_name == "", "GPU pods keep their scheduler unless configured"
    else:
        # Placed by the extender (the default install): every GPU pod goes to its scheduler.
        assert config["extender"]["enabled"] is True
        assert admission.scheduler_name == SCHEDULER_PROFILE
    assert set(config) <= {
        "server",
        "admission",
        "certs",
        "quota",
        "extender",
        "kubeconfig",
        "shutdown_delay_seconds",
    }
    deployment, container = _webhook(render(overlay))
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert 0 <= config["shutdown_delay_seconds"] < grace
    args = container["args"]
    config_path = args[args.index("--config") + 1]
    (mount,) = [m for m in container["volumeMounts"] if config_path.startswith(m["mountPath"])]
    (volume,) = [
        v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    ]
    assert volume["configMap"]["name"].startswith("fracgpu-config")
    assert config_path == f"{mount['mountPath']}/config.yaml"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_certs_section_is_accepted_by_the_certs_component(overlay: str) -> None:
    certs_config = pytest.importorskip(
        "certs.config", reason="certs.config is not in this tree yet (branch certs)"
    )
    config = config_of(render(overlay))
    certs = certs_config.CertsConfig.model_validate(config["certs"])
    assert (certs.service, certs.namespace) == ("fracgpu-webhook", NAMESPACE)
    objs = render(overlay)
    find(objs, "Service", certs.service)
    if certs.mode == "secret":
        find(objs, "Secret", certs.secret_name)
        assert certs.mutating_webhook_configurations == ["fracgpu-mutate"]
        assert certs.validating_webhook_configurations == ["fracgpu-validate"]
    else:
        assert certs.mode == "files"
        assert not certs.injects, "cert-manager's cainjector owns caBundle in this overlay"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_quota_section_is_accepted_and_decides_within_the_webhook_timeout(overlay: str) -> None:
    quota_config = pytest.importorskip(
        "quota.config", reason="quota.config is not in this tree yet (branch quota)"
    )
    objs = render(overlay)
    quota = quota_config.QuotaConfig.model_validate(config_of(objs)["quota"])
    (vwc,) = of_kind(objs, "ValidatingWebhookConfiguration")
    assert quota.timeout_s < vwc["webhooks"][0]["timeoutSeconds"]


def _without(config: dict[str, Any], *paths: tuple[str, ...]) -> dict[str, Any]:
    out = copy.deepcopy(config)
    for path in paths:
        node = out
        for key in path[:-1]:
            node = node[key]
        node.pop(path[-1], None)
    return out


def test_overlays_change_only_what_they_are_for() -> None:
    """The overlays carry whole copies of the config file; nothing else may drift from base."""
    base = config_of(render("default"))
    cert_manager = config_of(render("cert-manager"))
    dialects = config_of(render("dialects"))
    assert _without(cert_manager, ("certs",)) == _without(base, ("certs",))
    assert cert_manager["certs"]["mode"] == "files"
    assert _without(dialects, ("admission", "dialects")) == base
    assert dialects["admission"]["dialects"] == ["hami", "tkestack"]


def test_cert_manager_overlay_mounts_the_certificate_it_issues() -> None:
    objs = render("cert-manager")
    cert = find(objs, "Certificate", "fracgpu-webhook")
    service = find(objs, "Service", "fracgpu-webhook")
    svc_dns = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    assert svc_dns in cert["spec"]["dnsNames"]
    assert cert["spec"]["issuerRef"]["name"] in {
        i["metadata"]["name"] for i in of_kind(objs, "Issuer")
    }
    deployment, container = _webhook(objs)
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == cert["spec"]["secretName"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    certs = config_of(objs)["certs"]
    for key in ("cert_file", "key_file", "ca_file"):
        assert certs[key].startswith(mount["mountPath"] + "/"), key
    expected = f"{cert['metadata']['namespace']}/{cert['metadata']['name']}"
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        (wc,) = of_kind(objs, kind)
        assert wc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == expected
    assert not [s for s in of_kind(objs, "Secret")], "the self-managed Secret is not needed here"


def test_scheduler_profile_packs_the_canonical_resources() -> None:
    import yaml

    objs = render("default")
    (cm,) = [
        o
        for o in of_kind(objs, "ConfigMap")
        if o["metadata"]["name"].startswith("fracgpu-scheduler-config")
    ]
    sched = yaml.safe_load(cm["data"]["config.yaml"])
    assert sched["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert sched["kind"] == "KubeSchedulerConfiguration"
    (profile,) = sched["profiles"]
    assert profile["schedulerName"] == SCHEDULER_PROFILE
    (fit,) = [p for p in profile["pluginConfig"] if p["name"] == "NodeResourcesFit"]
    strategy = fit["args"]["scoringStrategy"]
    assert strategy["type"] == "MostAllocated"
    weights = {r["name"]: r["weight"] for r in strategy["resources"]}
    assert set(weights) == set(CANONICAL)
    assert all(1 <= w <= 100 for w in weights.values())
    election = sched["leaderElection"]
    assert election["leaderElect"] is True
    assert election["resourceName"] != "kube-scheduler", "must not fight the default scheduler"
    assert election["resourceNamespace"] == NAMESPACE
    lease_role = find(objs, "Role", "fracgpu-scheduler-lease")
    named = [r for r in lease_role["rules"] if r.get("resourceNames")]
    assert named[0]["resourceNames"] == [election["resourceName"]]

    deployment = find(objs, "Deployment", "fracgpu-scheduler")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    image = container["image"]
    assert image.startswith("registry.k8s.io/kube-scheduler:v1."), image
    minor = int(image.rsplit(":v1.", 1)[1].split(".")[0])
    assert 30 <= minor <= 37, f"{image} is outside the supported Kubernetes versions"
    flag = [a for a in container["command"] if a.startswith("--config=")]
    path = flag[0].split("=", 1)[1]
    (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    (volume,) = [
        v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    ]
    assert volume["configMap"]["name"] == cm["metadata"]["name"]


def test_images_are_pinned() -> None:
    for workload, spec in pod_specs(render("default")):
        for container in spec.get("initContainers", []) + spec["containers"]:
            image = container["image"]
            assert ":" in image.rsplit("/", 1)[-1] or "@sha256:" in image, (
                f"{workload['metadata']['name']}/{container['name']}: image {image} has no tag"
            )
            assert not image.endswith(":latest"), image
