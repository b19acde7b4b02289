"""deploy/overlays/dra: DRA mode renders, validates against the Kubernetes versions that serve
resource.k8s.io/v1 with consumable capacity, mounts what the plugin's flags name at the host's
paths, grants the plugin the least RBAC and the webhook every call DRA-mode admission makes
(the calls recorded against the fake API server), runs the webhook with ``allocation: dra``, and
its admission policy keeps each node's agent to its own node's slices (the CEL evaluated with
cel-python on sample requests)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from core import contract, dra
from core.kube import kube_client
from deviceplugin.dra.cli import add_parser, config_from
from quota.claims import CLAIM, TEMPLATE, ClaimSpecs
from testkit.apiserver import DEFAULT_NAMESPACES, FakeApiServer, RequestRecord
from tests.deploy_render import (
    NAMESPACE,
    Grant,
    Obj,
    config_of,
    find,
    grants_of,
    of_kind,
    pod_specs,
    policy_admits,
    render,
)
from tests.support import eventually
from webhook.claims import SliceModels, plan_claim
from webhook.claimstore import TemplateStore, referenced_templates, slice_informer
from webhook.config import AdmissionConfig
from webhook.parsing import ContainerAsk
from webhook.waitwatch import WaitExplainer

OVERLAY = "dra"
# DRA with consumable capacity on by default: 1.36 (the schemas of newer versions too).
VERSIONS = ("1.36.0", "1.37.0")
AGENT = f"system:serviceaccount:{NAMESPACE}:fracgpu-dra-plugin"
CUSTOM_KINDS = frozenset({"fracgpu.io/v1/GPUQuota"})


def _daemonset() -> tuple[Obj, Obj]:
    objs = render(OVERLAY)
    daemonset = find(objs, "DaemonSet", "fracgpu-dra-plugin")
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    return daemonset, container


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_validates(version: str) -> None:
    for obj in render(OVERLAY):
        if f"{obj['apiVersion']}/{obj['kind']}" in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{obj['kind']} {obj['metadata']['name']} is invalid for Kubernetes {version}: "
                f"{exc.message} at {list(exc.path)}"
            )


def test_the_device_plugin_is_not_deployed() -> None:
    """Nor what only it uses: its own-node policy and its node checks."""
    names = {o["metadata"]["name"] for o in render(OVERLAY)}
    assert not [n for n in names if n.startswith(("fracgpu-device-plugin", "fracgpu-node-checks"))]


def test_the_device_class_selects_the_driver() -> None:
    (device_class,) = of_kind(render(OVERLAY), "DeviceClass")
    config = config_from(_args())
    assert device_class["metadata"]["name"] == config.driver_name
    (selector,) = device_class["spec"]["selectors"]
    assert selector["cel"]["expression"] == f'device.driver == "{config.driver_name}"'


def _args() -> argparse.Namespace:
    _, container = _daemonset()
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args([*container["args"], "--node-name", "node-a"])


def _mounted_at_host_path(path: Path) -> bool:
    """A path inside the container is the same path on the host."""
    daemonset, container = _daemonset()
    volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
    for mount in container["volumeMounts"]:
        host = volumes[mount["name"]].get("hostPath", {}).get("path")
        inside = Path(mount["mountPath"])
        if host == mount["mountPath"] and (path == inside or inside in path.parents):
            return True
    return False


@pytest.mark.parametrize(
    "attribute",
    [
        pytest.param("registry_socket", id="registration-socket"),
        pytest.param("service_socket", id="service-socket"),
        pytest.param("checkpoint_path", id="checkpoint"),
        pytest.param("cdi_root", id="cdi-specs"),
        pytest.param("claims_dir", id="limits-and-accounting"),
        pytest.param("hook_library", id="hook"),
    ],
)
def test_what_the_plugin_uses_is_mounted_at_the_host_path(attribute: str) -> None:
    assert _mounted_at_host_path(getattr(config_from(_args()), attribute))


def test_host_paths_are_exactly_those() -> None:
    daemonset, _ = _daemonset()
    paths = {
        v["hostPath"]["path"]
        for v in daemonset["spec"]["template"]["spec"]["volumes"]
        if "hostPath" in v
    }
    assert paths == {
        "/var/lib/kubelet/plugins_registry",
        "/var/lib/kubelet/plugins",
        "/var/run/cdi",
        contract.HOST_ROOT,
        # the node guard's: which claims a container uses, and which container an ID is
        "/var/lib/kubelet/pod-resources",
        "/var/log/containers",
    }


def test_the_node_name_comes_from_the_pod() -> None:
    _, container = _daemonset()
    (env,) = [e for e in container["env"] if e["name"] == "NODE_NAME"]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_the_metrics_port_is_the_probed_port() -> None:
    _, container = _daemonset()
    (port,) = container["ports"]
    assert port["containerPort"] == config_from(_args()).metrics_port


def test_the_pod_is_hardened_and_bounded() -> None:
    for workload, spec in pod_specs(render(OVERLAY)):
        if workload["metadata"]["name"] != "fracgpu-dra-plugin":
            continue
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for container in spec["initContainers"] + spec["containers"]:
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, container["name"]
            assert sc["readOnlyRootFilesystem"] is True, container["name"]
            # KILL for the node guard only, in the plugin's container
            added = ["KILL"] if container["name"] == "dra-plugin" else []
            assert sc["capabilities"] == {"drop": ["ALL"], **({"add": added} if added else {})}
            assert sc.get("privileged", False) is False, container["name"]
            assert "memory" in container["resources"]["limits"], container["name"]
        assert spec["hostPID"] is True  # the guard reads and kills processes by node pid


def test_rbac_is_the_least_the_plugin_needs() -> None:
    role = find(render(OVERLAY), "ClusterRole", "fracgpu-dra-plugin")
    rules = {
        (group, resource): sorted(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert rules == {
        ("resource.k8s.io", "resourceslices"): sorted(
            ["get", "list", "watch", "create", "update", "delete"]
        ),
        ("resource.k8s.io", "resourceclaims"): ["get"],
        ("resource.k8s.io", "resourceclaims/status"): ["patch"],
        ("resource.k8s.io", "resourceclaims/driver"): ["associated-node:patch"],
        ("", "nodes"): ["get"],
        ("", "events"): ["create"],  # the node guard's findings, on the pod
    }
    (driver_rule,) = [r for r in role["rules"] if r["resources"] == ["resourceclaims/driver"]]
    assert driver_rule["resourceNames"] == [dra.DRIVER]


def test_it_reads_only_the_daemonsets_of_its_namespace() -> None:
    # whether its stop is an uninstall, and whether the other mode's agent is installed
    # (deviceplugin/shared/uninstall.py); nothing else namespaced
    grants, builtin = grants_of(render(OVERLAY), "fracgpu-dra-plugin")
    assert {g for g in grants if g[0] != "cluster"} == {
        (NAMESPACE, "apps", "daemonsets", "*any*", verb) for verb in ("get", "list", "watch")
    }
    assert builtin == set()


def test_the_role_is_bound_to_the_pods_service_account() -> None:
    objs = render(OVERLAY)
    binding = find(objs, "ClusterRoleBinding", "fracgpu-dra-plugin")
    daemonset, _ = _daemonset()
    (subject,) = binding["subjects"]
    assert (subject["name"], subject["namespace"]) == (
        daemonset["spec"]["template"]["spec"]["serviceAccountName"],
        NAMESPACE,
    )


# ---- the admission policy ----------------------------------------------------------------------


def _policy() -> Obj:
    return find(render(OVERLAY), "ValidatingAdmissionPolicy", "fracgpu-dra-plugin-own-node")


def _admitted(
    *,
    user: str = AGENT,
    token_node: str | None = "node-a",
    operation: str = "CREATE",
    slice_node: str = "node-a",
) -> bool:
    extra = {} if token_node is None else {"authentication.kubernetes.io/node-name": [token_node]}
    obj = {"spec": {"nodeName": slice_node, "driver": "gpu.fracgpu.io"}}
    request = {"userInfo": {"username": user, "extra": extra}, "operation": operation}
    return policy_admits(
        _policy(),
        request,
        None if operation == "DELETE" else obj,
        obj if operation != "CREATE" else None,
    )


@pytest.mark.parametrize(
    ("request_", "admitted"),
    [
        pytest.param({}, True, id="own-node-create"),
        pytest.param({"operation": "UPDATE"}, True, id="own-node-update"),
        pytest.param({"operation": "DELETE"}, True, id="own-node-delete"),
        pytest.param({"slice_node": "node-b"}, False, id="other-node-create"),
        pytest.param(
            {"slice_node": "node-b", "operation": "DELETE"}, False, id="other-node-delete"
        ),
        pytest.param({"token_node": None}, False, id="token-without-node"),
        pytest.param({"user": "system:node:node-b", "slice_node": "node-b"}, True, id="kubelet"),
    ],
)
def test_the_policy_keeps_the_agent_to_its_node(request_: dict[str, Any], admitted: bool) -> None:
    assert _admitted(**request_) is admitted


def test_the_policy_denies_and_applies_to_resourceslices() -> None:
    objs = render(OVERLAY)
    binding = find(objs, "ValidatingAdmissionPolicyBinding", "fracgpu-dra-plugin-own-node")
    assert binding["spec"]["validationActions"] == ["Deny"]
    (rule,) = _policy()["spec"]["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["resourceslices"]


# ---- the webhook in DRA mode -------------------------------------------------------------------

SA_WEBHOOK = "fracgpu-webhook"


def test_the_webhook_admits_in_dra_mode() -> None:
    admission = AdmissionConfig.model_validate(config_of(render(OVERLAY))["admission"])
    assert admission.allocation == "dra"


def _without_allocation(config: Obj) -> Obj:
    admission = {k: v for k, v in config["admission"].items() if k != "allocation"}
    return {**config, "admission": admission}


def test_the_webhook_config_is_the_base_one_but_for_the_mode() -> None:
    # the base as is: node-placement (the default overlay adds the extender, device-plugin only)
    dra, base = config_of(render(OVERLAY)), config_of(render("node-placement"))
    assert _without_allocation(dra) == base


def _grant_of(record: RequestRecord) -> Grant:
    """The RBAC check a request is subject to: (scope, group, resource, name, verb)."""
    parts = record.path.strip("/").split("/")
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    scope = "cluster"
    if rest[0] == "namespaces" and len(rest) > 2:
        scope, rest = rest[1], rest[2:]
    resource, name = rest[0], rest[1] if len(rest) > 1 else None
    if record.method == "GET":
        verb = "get" if name else "watch" if record.query.get("watch") == "true" else "list"
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}[
            record.method
        ]
    return scope, group, resource, name or "*any*", verb


def _allowed(grant: Grant, grants: set[Grant]) -> bool:
    scope, group, resource, name, verb = grant
    return any(
        (where, group, resource, which, verb) in grants
        for where in {scope, "cluster"}
        for which in {name, "*any*"}
    )


def _waiting_pod() -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "waiting", "namespace": "team-a", "uid": "uid-waiting"},
        "spec": {"containers": [{"name": "c", "image": "x"}]},
        "status": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/1 nodes are available: 1 cannot allocate all claims.",
                }
            ],
            "resourceClaimStatuses": [{"name": "gpu-0", "resourceClaimName": "waiting-gpu-0"}],
        },
    }


def _waiting_claim() -> Obj:
    request = {
        "name": "gpu",
        "exactly": {
            "deviceClassName": "gpu.fracgpu.io",
            "count": 1,
            "capacity": {"requests": {"cores": "50", "memory": "8Gi"}},
        },
    }
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "waiting-gpu-0", "namespace": "team-a"},
        "spec": {"devices": {"requests": [request]}},
    }


async def _dra_admission_requests(tmp_path: Path) -> list[RequestRecord]:
    """Every request DRA-mode admission makes, each of its parts driven once through the paths
    that call the API server: templates created, found and touched, collected (workloads
    listed); claims and templates read by quota; slices, claims and pods followed; an Event
    posted on a pod that waits."""
    async with (
        FakeApiServer(namespaces=(*DEFAULT_NAMESPACES, "team-a")) as fake,
        kube_client(fake.kubeconfig(tmp_path / "kubeconfig")) as api,
    ):
        now = [1000.0]
        store = TemplateStore(api, grace_s=0, touch_interval_s=0, clock=lambda: now[0])
        plan = plan_claim("c", ContainerAsk(core=30, memory_mib=8192), {}, max_cards=16)
        await store.ensure("team-a", plan, dry_run=False)
        now[0] += 60
        await TemplateStore(api, clock=lambda: now[0]).ensure("team-a", plan, dry_run=False)
        fake.put(_waiting_claim())
        await ClaimSpecs(api).load([("team-a", TEMPLATE, plan.name), ("team-a", CLAIM, "x")])
        await ClaimSpecs(api).load([("team-a", CLAIM, "waiting-gpu-0")])
        now[0] += 60
        await store.collect({"team-a": await referenced_templates(api, "team-a")})
        assert await store.managed() == []
        fake.put(_waiting_pod())
        async with slice_informer(api, SliceModels()) as slices:
            await slices.wait_synced()
        explainer = WaitExplainer(api, interval_s=0.05)
        task = asyncio.create_task(explainer.run())
        try:
            await eventually(lambda: len(fake.objects("events", "team-a")) == 1)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return list(fake.requests)


async def test_the_webhook_may_make_every_call_dra_admission_makes(tmp_path: Path) -> None:
    grants, _ = grants_of(render(OVERLAY), SA_WEBHOOK)
    made = {_grant_of(record) for record in await _dra_admission_requests(tmp_path)}
    assert {grant for grant in made if not _allowed(grant, grants)} == set()


@pytest.mark.parametrize(
    "grant",
    [
        pytest.param(("team-a", "resource.k8s.io", "resourceclaimtemplates", v, "*any*"), id=v)
        for v in ("create", "get", "patch", "delete", "list")
    ]
    + [
        pytest.param(("cluster", "resource.k8s.io", r, v, "*any*"), id=f"{r}-{v}")
        for r in ("resourceslices", "resourceclaims")
        for v in ("list", "watch")
    ]
    + [
        pytest.param(("cluster", g, r, "list", "*any*"), id=f"{r}-list")
        for g, r in (
            ("", "pods"),
            ("apps", "deployments"),
            ("apps", "replicasets"),
            ("apps", "statefulsets"),
            ("apps", "daemonsets"),
            ("batch", "jobs"),
            ("batch", "cronjobs"),
        )
    ]
    + [pytest.param(("team-a", "", "events", "create", "*any*"), id="events-create")],
)
def test_the_webhook_is_granted(grant: tuple[str, str, str, str, str]) -> None:
    """The calls DRA-mode admission is documented to make (docs/install.md), in any namespace."""
    scope, group, resource, verb, name = grant
    grants, _ = grants_of(render(OVERLAY), SA_WEBHOOK)
    assert _allowed((scope, group, resource, name, verb), grants)


def test_the_recorded_calls_are_read_as_rbac_checks_them() -> None:
    records = [
        RequestRecord("GET", "/api/v1/namespaces/team-a/pods", {"watch": "true"}),
        RequestRecord(
            "PATCH", "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaimtemplates/t", {}
        ),
        RequestRecord("GET", "/apis/resource.k8s.io/v1/resourceslices", {}),
    ]
    assert [_grant_of(r) for r in records] == [
        ("team-a", "", "pods", "*any*", "watch"),
        ("team-a", "resource.k8s.io", "resourceclaimtemplates", "t", "patch"),
        ("cluster", "resource.k8s.io", "resourceslices", "*any*", "list"),
    ]


# ---- the DeviceClass policy ---------------------------------------------------------------------


def _class_admitted(name: str, spec: Obj) -> bool:
    policy = find(render(OVERLAY), "ValidatingAdmissionPolicy", "fracgpu-device-classes")
    obj = {"metadata": {"name": name}, "spec": spec}
    return policy_admits(policy, {"operation": "CREATE", "userInfo": {}}, obj, None)


def _selectors(*expressions: str) -> Obj:
    return {"selectors": [{"cel": {"expression": e}} for e in expressions]}


@pytest.mark.parametrize(
    ("name", "spec", "admitted"),
    [
        pytest.param(
            "gpu.fracgpu.io", _selectors('device.driver == "gpu.fracgpu.io"'), True, id="ours"
        ),
        pytest.param(
            "gpu.fracgpu.io",
            {**_selectors('device.driver == "gpu.fracgpu.io"'), "extendedResourceName": "x.io/g"},
            False,
            id="ours-with-an-explicit-extended-resource",
        ),
        pytest.param(
            "nic", _selectors('device.driver == "nic.example.com"'), True, id="other-driver"
        ),
        pytest.param(
            "nvidia",
            _selectors(
                "device.driver == 'gpu.nvidia.com' && "
                "device.attributes['gpu.nvidia.com'].type == 'gpu'"
            ),
            True,
            id="other-driver-and-a-condition",
        ),
        pytest.param(
            "nic",
            {
                **_selectors('device.driver == "nic.example.com"'),
                "extendedResourceName": "x.io/nic",
            },
            True,
            id="other-driver-with-an-extended-resource",
        ),
        pytest.param("all", {}, False, id="no-selectors"),
        pytest.param(
            "sneaky", _selectors('device.driver == "gpu.fracgpu.io"'), False, id="our-driver"
        ),
        pytest.param(
            "widened",
            _selectors('device.driver == "nic.example.com" || true'),
            False,
            id="or-widens",
        ),
        pytest.param(
            "ternary",
            _selectors('device.driver == "nic.example.com" && false ? false : true'),
            False,
            id="ternary-widens",
        ),
        pytest.param(
            "attr", _selectors("device.attributes['x'].model == 'H100'"), False, id="no-driver-pin"
        ),
    ],
)
def test_only_fracgpus_class_reaches_its_devices(name: str, spec: Obj, admitted: bool) -> None:
    assert _class_admitted(name, spec) is admitted
