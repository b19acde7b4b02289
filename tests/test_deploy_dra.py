"""deploy/overlays/dra: DRA mode's node side renders, validates against the Kubernetes versions
that serve resource.k8s.io/v1 with consumable capacity, mounts what the plugin's flags name at
the host's paths, grants the least RBAC, and its admission policy keeps each node's agent to its
own node's slices (the CEL evaluated with cel-python on sample requests)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import celpy
import kubernetes_validate
import pytest

from core import contract
from deviceplugin.dra.cli import add_parser, config_from
from tests.deploy_render import NAMESPACE, Obj, find, of_kind, pod_specs, render

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
    names = {o["metadata"]["name"] for o in render(OVERLAY)}
    assert "fracgpu-device-plugin" not in names


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
            assert sc["capabilities"] == {"drop": ["ALL"]}, container["name"]
            assert sc.get("privileged", False) is False, container["name"]
            assert "memory" in container["resources"]["limits"], container["name"]


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
        ("", "nodes"): ["get"],
    }


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


def _evaluate(expression: str, activation: dict[str, Any]) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(expression)).evaluate(activation)


def _admitted(
    *,
    user: str = AGENT,
    token_node: str | None = "node-a",
    operation: str = "CREATE",
    slice_node: str = "node-a",
) -> bool:
    policy = _policy()
    extra = {} if token_node is None else {"authentication.kubernetes.io/node-name": [token_node]}
    obj = {"spec": {"nodeName": slice_node, "driver": "gpu.fracgpu.io"}}
    request = {"userInfo": {"username": user, "extra": extra}, "operation": operation}
    activation: dict[str, Any] = {
        "request": celpy.json_to_cel(request),
        "object": celpy.json_to_cel(None if operation == "DELETE" else obj),
        "oldObject": celpy.json_to_cel(obj if operation != "CREATE" else None),
    }
    (condition,) = policy["spec"]["matchConditions"]
    if not bool(_evaluate(condition["expression"], activation)):
        return True  # not the agent: the policy does not apply
    variables = {}
    for variable in policy["spec"]["variables"]:
        variables[variable["name"]] = _evaluate(
            variable["expression"], {**activation, "variables": celpy.json_to_cel(variables)}
        )
    activation["variables"] = celpy.json_to_cel({k: str(v) for k, v in variables.items()})
    return all(bool(_evaluate(v["expression"], activation)) for v in policy["spec"]["validations"])


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
