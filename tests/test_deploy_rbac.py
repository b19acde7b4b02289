"""RBAC in deploy/ is the least each component needs (design §7): every grant is listed here, so
adding one is a reviewed change to this test, and the general rules hold in every overlay."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy_render import (
    NAMESPACE,
    OVERLAYS,
    Grant,
    find,
    grants_of,
    of_kind,
    policy_admits,
    render,
)

SA_WEBHOOK = "fracgpu-webhook"
SA_PLUGIN = "fracgpu-device-plugin"
SA_SCHEDULER = "fracgpu-scheduler"


def _all(scope: str, group: str, resource: str, verbs: str, name: str = "*any*") -> set[Grant]:
    return {(scope, group, resource, name, v) for v in verbs.split()}


WEBHOOK_CORE = (
    _all("cluster", "", "nodes", "get list watch")
    | _all("cluster", "", "pods", "get list watch")
    | _all("cluster", "fracgpu.io", "gpuquotas", "get list watch update patch")
    | _all("cluster", "fracgpu.io", "gpuquotas/status", "get list watch update patch")
    | _all(NAMESPACE, "coordination.k8s.io", "leases", "get list watch create update patch")
    # admission.allocation auto: does fracgpu's DeviceClass exist (webhook/mode.py)?
    | _all("cluster", "resource.k8s.io", "deviceclasses", "get", "gpu.fracgpu.io")
    # GPUShareDoesNotFit on a pod that waits Pending, in both modes (webhook/waitwatch.py)
    | _all("cluster", "", "events", "create")
    # the scheduler extender: per-node ledgers by compare-and-swap, and the Bindings it posts
    | _all("cluster", "fracgpu.io", "gpunodeledgers", "get list watch create update")
    | _all("cluster", "", "pods/binding", "create")
)
WEBHOOK_OWN_CERTS = (
    _all(NAMESPACE, "", "secrets", "get watch update patch", "fracgpu-webhook-tls")
    | _all(
        "cluster",
        "admissionregistration.k8s.io",
        "mutatingwebhookconfigurations",
        "get update patch",
        "fracgpu-mutate",
    )
    | _all(
        "cluster",
        "admissionregistration.k8s.io",
        "validatingwebhookconfigurations",
        "get update patch",
        "fracgpu-validate",
    )
    # certs.inject's informers list and watch the whole kind (tests/test_deploy_serve.py).
    | _all("cluster", "admissionregistration.k8s.io", "mutatingwebhookconfigurations", "list watch")
    | _all(
        "cluster", "admissionregistration.k8s.io", "validatingwebhookconfigurations", "list watch"
    )
)


# With extender placement (the default install) serve also keeps the scheduler's client
# certificate for the extender's port in its Secret, and restarts the scheduler (a patch of its
# Deployment's pod template) when the CAs in it change.
SCHEDULER_CLIENT_CERT = _all(
    NAMESPACE, "", "secrets", "get watch update patch", "fracgpu-scheduler-client-tls"
) | _all(NAMESPACE, "apps", "deployments", "patch", "fracgpu-scheduler")


@pytest.mark.parametrize("overlay", ["default", "dialects", "network-policy"])
def test_webhook_grants_with_its_own_certificates(overlay: str) -> None:
    grants, builtin = grants_of(render(overlay), SA_WEBHOOK)
    assert grants == WEBHOOK_CORE | WEBHOOK_OWN_CERTS | SCHEDULER_CLIENT_CERT
    assert builtin == set()


def test_webhook_grants_with_node_placement() -> None:
    grants, builtin = grants_of(render("node-placement"), SA_WEBHOOK)
    assert grants == WEBHOOK_CORE | WEBHOOK_OWN_CERTS
    assert builtin == set()


def test_webhook_grants_with_cert_manager() -> None:
    """cert-manager issues both certificates: the webhook touches no Secret."""
    grants, builtin = grants_of(render("cert-manager"), SA_WEBHOOK)
    assert grants == WEBHOOK_CORE
    assert builtin == set()


def test_webhook_configuration_grants_name_the_deployed_configurations() -> None:
    objs = render("default")
    names = {
        (wc["kind"].lower() + "s", wc["metadata"]["name"])
        for wc in of_kind(objs, "MutatingWebhookConfiguration")
        + of_kind(objs, "ValidatingWebhookConfiguration")
    }
    granted = {
        (g[2], g[3])
        for g in WEBHOOK_OWN_CERTS
        if g[1] == "admissionregistration.k8s.io" and g[3] != "*any*"
    }
    assert granted == names
    find(objs, "Secret", "fracgpu-webhook-tls")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_device_plugin_may_only_read_and_patch_nodes_post_events_get_pods_and_daemonsets(
    overlay: str,
) -> None:
    grants, builtin = grants_of(render(overlay), SA_PLUGIN)
    # nodes/status: the allocatable GPU resources (node.AllocatableMirror); events: the node
    # guard's reports on pods over their memory grant (guardevents.py); pods, get alone (no
    # list, no watch): a bursting share's compute policy (classic/policies.py); daemonsets in
    # its own namespace: whether its stop is an uninstall (shared/uninstall.py)
    assert grants == (
        _all("cluster", "", "nodes", "get patch")
        | _all("cluster", "", "nodes/status", "patch")
        | _all("cluster", "", "events", "create")
        | _all("cluster", "", "pods", "get")
        | _all(NAMESPACE, "apps", "daemonsets", "get list watch")
    )
    assert builtin == set()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_scheduler_has_the_stock_roles_and_its_own_lease(overlay: str) -> None:
    grants, builtin = grants_of(render(overlay), SA_SCHEDULER)
    assert builtin == {
        "cluster:system:kube-scheduler",
        "cluster:system:volume-scheduler",
        "kube-system:extension-apiserver-authentication-reader",
    }
    assert grants == _all(NAMESPACE, "coordination.k8s.io", "leases", "create") | _all(
        NAMESPACE, "coordination.k8s.io", "leases", "get update", "fracgpu-scheduler"
    )


# The only deletions any role may make, each for a reason: the DRA plugin replaces its own
# node's ResourceSlice (a ValidatingAdmissionPolicy keeps it to that node), and DRA admission
# garbage-collects the shared ResourceClaimTemplates it made.
MAY_DELETE = {
    ("fracgpu-dra-plugin", "resource.k8s.io", "resourceslices"),
    ("fracgpu-webhook-dra", "resource.k8s.io", "resourceclaimtemplates"),
}
ACCOUNTS = {
    **{overlay: {SA_WEBHOOK, SA_PLUGIN, SA_SCHEDULER} for overlay in OVERLAYS},
    "dra": {SA_WEBHOOK, "fracgpu-dra-plugin", SA_SCHEDULER},
}


@pytest.mark.parametrize("overlay", [*OVERLAYS, "dra"])
def test_general_rules(overlay: str) -> None:
    objs = render(overlay)
    for role in of_kind(objs, "ClusterRole") + of_kind(objs, "Role"):
        where = f"{role['kind']} {role['metadata']['name']}"
        assert "aggregationRule" not in role, where
        for rule in role["rules"]:
            fields: list[Any] = [
                *rule["apiGroups"],
                *rule["resources"],
                *rule["verbs"],
                *rule.get("resourceNames", []),
            ]
            assert "*" not in fields, f"{where}: wildcard in {rule}"
            assert "nonResourceURLs" not in rule, where
            assert not {"escalate", "bind", "impersonate", "deletecollection"} & set(
                rule["verbs"]
            ), f"{where}: {rule['verbs']}"
            if "delete" in rule["verbs"]:
                deletes = {
                    (role["metadata"]["name"], group, resource)
                    for group in rule["apiGroups"]
                    for resource in rule["resources"]
                }
                assert deletes <= MAY_DELETE, f"{where}: delete on {rule}"
            if role["kind"] == "ClusterRole":
                assert "secrets" not in rule["resources"], f"{where}: Secrets cluster-wide"
            if "secrets" in rule["resources"]:
                assert rule.get("resourceNames"), f"{where}: Secrets not restricted by name"
    for binding in of_kind(objs, "ClusterRoleBinding") + of_kind(objs, "RoleBinding"):
        assert binding["roleRef"]["name"] != "cluster-admin"
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount", binding["metadata"]["name"]
            assert subject["namespace"] == NAMESPACE
    accounts = {sa["metadata"]["name"] for sa in of_kind(objs, "ServiceAccount")}
    assert accounts == ACCOUNTS[overlay]
    for workload in of_kind(objs, "Deployment") + of_kind(objs, "DaemonSet"):
        assert workload["spec"]["template"]["spec"]["serviceAccountName"] in accounts


# ---- the device plugin's admission policy ------------------------------------------------------


def _plugin_admitted(
    *,
    user: str = f"system:serviceaccount:{NAMESPACE}:{SA_PLUGIN}",
    token_node: str | None = "node-a",
    node: str = "node-a",
) -> bool:
    policy = find(render("default"), "ValidatingAdmissionPolicy", "fracgpu-device-plugin-own-node")
    extra = {} if token_node is None else {"authentication.kubernetes.io/node-name": [token_node]}
    obj = {"metadata": {"name": node}, "status": {"allocatable": {"fracgpu.io/core": "100"}}}
    request = {"userInfo": {"username": user, "extra": extra}, "operation": "UPDATE"}
    return policy_admits(policy, request, obj, obj)


@pytest.mark.parametrize(
    ("request_", "admitted"),
    [
        pytest.param({}, True, id="own-node"),
        pytest.param({"node": "node-b"}, False, id="another-node"),
        pytest.param({"token_node": None}, False, id="token-without-node"),
        pytest.param({"user": "system:node:node-b", "node": "node-b"}, True, id="kubelet"),
        pytest.param({"user": "system:admin", "node": "node-b"}, True, id="anyone-else"),
    ],
)
def test_the_device_plugin_may_change_only_its_own_node(
    request_: dict[str, Any], admitted: bool
) -> None:
    assert _plugin_admitted(**request_) is admitted


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_policy_covers_the_node_and_its_status_and_denies(overlay: str) -> None:
    objs = render(overlay)
    name = "fracgpu-device-plugin-own-node"
    binding = find(objs, "ValidatingAdmissionPolicyBinding", name)
    assert binding["spec"]["validationActions"] == ["Deny"]
    (rule,) = find(objs, "ValidatingAdmissionPolicy", name)["spec"]["matchConstraints"][
        "resourceRules"
    ]
    assert rule["resources"] == ["nodes", "nodes/status"]
    assert rule["operations"] == ["UPDATE"]  # a PATCH is admitted as an UPDATE
