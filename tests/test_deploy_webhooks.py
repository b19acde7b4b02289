"""The webhook configurations in deploy/ agree with the server's code, and their matchConditions
send exactly the objects the webhook must see.

The CEL is evaluated with cel-python on sample objects. cel-python is a second implementation of
CEL, not the API server's; the e2e suite (tests/e2e) runs the same expressions in a real API
server. The property test ties the CEL to the mutation code: whatever the CEL lets through
unsent, the webhook would have allowed unchanged anyway.
"""

from __future__ import annotations

import functools
from typing import Any

import celpy
import jsonpatch
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core import dra
from core.contract import VISIBLE_DEVICES_ENV as VISIBLE_DEVICES
from core.units import ENV_GPU, ENV_MEMORY_MIB
from tests.deploy_render import NAMESPACE, OVERLAYS, Obj, find, of_kind, render
from webhook import server
from webhook.config import AdmissionConfig, ServerConfig
from webhook.dialects import (
    ALWAYS_ON,
    DIALECT_RESOURCES,
    OPTIONAL_DIALECTS,
    Dialect,
    enabled,
    input_resources,
)
from webhook.inventory import Inventory
from webhook.mutation import EPHEMERAL, TEMPLATE_PATHS, Mutator

MUTATE_NAME = "mutate.fracgpu.io"
QUOTA_NAME = "quota.fracgpu.io"
# Plural resource names of the kinds the mutating webhook handles, as webhook rules name them.
PLURALS = {
    "Pod": "pods",
    "Deployment": "deployments",
    "ReplicaSet": "replicasets",
    "StatefulSet": "statefulsets",
    "DaemonSet": "daemonsets",
    "Job": "jobs",
    "CronJob": "cronjobs",
}


def _mutating(overlay: str = "default") -> Obj:
    (wc,) = of_kind(render(overlay), "MutatingWebhookConfiguration")
    assert wc["metadata"]["name"] == "fracgpu-mutate"
    (hook,) = wc["webhooks"]
    assert hook["name"] == MUTATE_NAME
    return dict(hook)


def _validating(overlay: str = "default") -> Obj:
    (wc,) = of_kind(render(overlay), "ValidatingWebhookConfiguration")
    assert wc["metadata"]["name"] == "fracgpu-validate"
    (hook,) = wc["webhooks"]
    assert hook["name"] == QUOTA_NAME
    return dict(hook)


# --- names, paths, ports ------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_paths_are_the_servers_and_reach_its_port(overlay: str) -> None:
    objs = render(overlay)
    service = find(objs, "Service", "fracgpu-webhook")
    deployment = find(objs, "Deployment", "fracgpu-webhook")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for hook, path in (
        (_mutating(overlay), server.MUTATE_PATH),
        (_validating(overlay), server.VALIDATE_PATH),
    ):
        svc_ref = hook["clientConfig"]["service"]
        assert (svc_ref["name"], svc_ref["namespace"]) == ("fracgpu-webhook", NAMESPACE)
        assert svc_ref["path"] == path
        (svc_port,) = [p for p in service["spec"]["ports"] if p["port"] == svc_ref["port"]]
        target = svc_port["targetPort"]
        container_port = ports[target] if isinstance(target, str) else target
        assert container_port == ServerConfig().port == 8443
    assert service["spec"]["selector"].items() <= (
        deployment["spec"]["template"]["metadata"]["labels"].items()
    )


def test_server_registers_the_paths_the_manifests_use() -> None:
    async def reviewer(_: Any) -> Any:
        raise AssertionError("not called")

    app = server.build_app({server.MUTATE_PATH: reviewer, server.VALIDATE_PATH: reviewer})
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource}
    assert ("POST", "/mutate") in routes
    assert ("POST", "/validate") in routes
    objs = render("default")
    (container,) = find(objs, "Deployment", "fracgpu-webhook")["spec"]["template"]["spec"][
        "containers"
    ]
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["scheme"] == "HTTPS"
        assert ("GET", get["path"]) in routes
    assert container["readinessProbe"]["httpGet"]["path"] == server.READY_PATH
    assert container["livenessProbe"]["httpGet"]["path"] == server.HEALTH_PATH


def test_mutating_rules_cover_exactly_the_kinds_the_mutator_handles() -> None:
    hook = _mutating()
    covered: set[tuple[str, str, str]] = set()
    for rule in hook["rules"]:
        assert rule["apiVersions"] == ["v1"]
        assert rule["scope"] == "Namespaced"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for op in rule["operations"]:
                    covered.add((group, resource, op))
    expected = set()
    for group, kind in TEMPLATE_PATHS:
        # Pod resources are immutable after CREATE; templates change on every rollout.
        ops = ("CREATE",) if kind == "Pod" else ("CREATE", "UPDATE")
        expected |= {(group, PLURALS[kind], op) for op in ops}
    # kubectl debug's ephemeral containers, which the mutator checks (and does not rewrite).
    expected.add(("", f"pods/{EPHEMERAL}", "UPDATE"))
    assert covered == expected


def test_validating_rule_is_pod_create_only() -> None:
    (rule,) = _validating()["rules"]
    assert (rule["apiGroups"], rule["resources"], rule["operations"]) == (
        [""],
        ["pods"],
        ["CREATE"],
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_webhook_settings_fail_closed_but_narrowly(overlay: str) -> None:
    for hook in (_mutating(overlay), _validating(overlay)):
        assert hook["admissionReviewVersions"] == ["v1"]
        assert hook["sideEffects"] == "NoneOnDryRun"
        assert hook["failurePolicy"] == "Fail"
        assert 1 <= hook["timeoutSeconds"] <= 10
        (expr,) = hook["namespaceSelector"]["matchExpressions"]
        assert expr["key"] == "kubernetes.io/metadata.name"
        assert expr["operator"] == "NotIn"
        assert {"kube-system", NAMESPACE} <= set(expr["values"])
        assert [c["name"] for c in hook["matchConditions"]] == ["mentions-gpu"]
        assert "objectSelector" not in hook, "labels are user-controlled: no opt-out by label"
    assert _mutating(overlay)["reinvocationPolicy"] == "IfNeeded"


# --- matchConditions ----------------------------------------------------------------------------


class Condition:
    """One matchCondition, compiled once, evaluated like the API server does on an object."""

    def __init__(self, expression: str) -> None:
        env = celpy.Environment()
        self.program = env.program(env.compile(expression))

    def __call__(self, obj: Obj, kind: str = "Pod") -> bool:
        activation = {
            "object": celpy.json_to_cel(obj),
            "request": celpy.json_to_cel({"kind": {"kind": kind}, "operation": "CREATE"}),
        }
        result = self.program.evaluate(activation)
        assert isinstance(result, celpy.celtypes.BoolType), f"CEL gave {result!r}"
        return bool(result)


@functools.cache
def _compiled(expression: str) -> Condition:
    return Condition(expression)


def _condition(hook: Obj) -> Condition:
    (cond,) = hook["matchConditions"]
    return _compiled(cond["expression"])


def pod(*, containers: list[Obj] | None = None, init: list[Obj] | None = None) -> Obj:
    spec: Obj = {"containers": containers or [{"name": "main", "image": "busybox"}]}
    if init is not None:
        spec["initContainers"] = init
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": spec}


def container(
    limits: Obj | None = None, requests: Obj | None = None, env: Any = None, mounts: Any = None
) -> Obj:
    c: Obj = {"name": "c", "image": "busybox"}
    if mounts is not None:
        c["volumeMounts"] = [{"name": "v", "mountPath": m} for m in mounts]
    resources: Obj = {}
    if limits is not None:
        resources["limits"] = limits
    if requests is not None:
        resources["requests"] = requests
    if resources:
        c["resources"] = resources
    if env is not None:
        c["env"] = env
    return c


def wrap(pod_obj: Obj, kind: str) -> Obj:
    """Put a pod's spec where the workload kind keeps its template (TEMPLATE_PATHS)."""
    group = next(g for g, k in TEMPLATE_PATHS if k == kind)
    path = TEMPLATE_PATHS[(group, kind)]
    if not path:
        return pod_obj
    obj: Obj = {"apiVersion": f"{group}/v1", "kind": kind, "metadata": {"name": "w"}}
    node = obj
    for token in path[:-1]:
        node = node.setdefault(token, {})
    node[path[-1]] = {"metadata": {"labels": {"a": "b"}}, "spec": pod_obj["spec"]}
    return obj


ALWAYS = sorted(input_resources(enabled([])))
DIALECT_ONLY = sorted(input_resources(OPTIONAL_DIALECTS) - input_resources(enabled([])))


def test_sample_resources_are_the_webhooks_own() -> None:
    assert sorted(r for d in ALWAYS_ON for r in DIALECT_RESOURCES[d]) == ALWAYS
    assert all(
        name.startswith("fracgpu.io/") or name == dra.DEVICE_CLASS_RESOURCE for name in ALWAYS
    )
    assert not any(name.startswith("fracgpu.io/") for name in DIALECT_ONLY)


@pytest.mark.parametrize("kind", sorted({k for _, k in TEMPLATE_PATHS}))
@pytest.mark.parametrize("resource", ALWAYS)
def test_every_input_and_canonical_resource_is_sent(kind: str, resource: str) -> None:
    cond = _condition(_mutating())
    for where in ("limits", "requests"):
        c = container(**{where: {resource: "1"}})
        assert cond(wrap(pod(containers=[container(), c]), kind), kind), (resource, where)
        assert cond(wrap(pod(init=[c]), kind), kind), (resource, where, "init")
    assert not cond(wrap(pod(), kind), kind)
    assert not cond(wrap(pod(containers=[container({"cpu": "1", "memory": "1Gi"})]), kind), kind)


@pytest.mark.parametrize("kind", sorted({k for _, k in TEMPLATE_PATHS}))
@pytest.mark.parametrize("variable", [VISIBLE_DEVICES, ENV_GPU, ENV_MEMORY_MIB])
def test_system_variables_are_sent_from_any_pod(kind: str, variable: str) -> None:
    """The webhook denies these on any pod, GPU or not, so it must see every pod that sets them."""
    cond = _condition(_mutating())
    env = [{"name": "A", "value": "1"}, {"name": variable, "value": "all"}]
    assert cond(wrap(pod(containers=[container(env=env)]), kind), kind)
    assert cond(wrap(pod(init=[container(env=env[1:])]), kind), kind)
    assert not cond(wrap(pod(containers=[container(env=env[:1])]), kind), kind)


@pytest.mark.parametrize("overlay", ["default", "dialects"])
@pytest.mark.parametrize(
    "ephemeral",
    [
        pytest.param({"env": [{"name": VISIBLE_DEVICES, "value": "all"}]}, id="visible-devices"),
        pytest.param({"env": [{"name": ENV_GPU, "value": "1"}]}, id="system-variable"),
        pytest.param(
            {"volumeMounts": [{"name": "v", "mountPath": "/var/run/nvidia-container-devices/a"}]},
            id="device-list-mount",
        ),
    ],
)
def test_ephemeral_containers_that_set_system_things_are_sent(overlay: str, ephemeral: Obj) -> None:
    obj = pod()
    obj["spec"]["ephemeralContainers"] = [{"name": "debugger", "image": "busybox", **ephemeral}]
    assert _condition(_mutating(overlay))(obj)


def test_plain_ephemeral_containers_of_plain_pods_are_not_sent() -> None:
    obj = pod()
    obj["spec"]["ephemeralContainers"] = [{"name": "debugger", "image": "busybox"}]
    assert not _condition(_mutating())(obj)


@pytest.mark.parametrize("kind", sorted({k for _, k in TEMPLATE_PATHS}))
@pytest.mark.parametrize(
    "path",
    [
        "/var/run/nvidia-container-devices/all",
        "/run/nvidia-container-devices/GPU-1",
        "//var/run/./nvidia-container-devices",
    ],
)
def test_device_list_mounts_are_sent_from_any_pod(kind: str, path: str) -> None:
    cond = _condition(_mutating())
    mounting = container()
    mounting["volumeMounts"] = [{"name": "v", "mountPath": path}]
    assert cond(wrap(pod(containers=[mounting]), kind), kind)


@pytest.mark.parametrize("kind", sorted({k for _, k in TEMPLATE_PATHS}))
def test_cdi_annotations_are_sent_from_any_pod(kind: str) -> None:
    cond = _condition(_mutating())
    obj = pod()
    obj["metadata"]["annotations"] = {"cdi.k8s.io/gpu": "nvidia.com/gpu=all"}
    wrapped = wrap(obj, kind)
    if kind != "Pod":
        template = wrapped
        for token in TEMPLATE_PATHS[next((g, k) for g, k in TEMPLATE_PATHS if k == kind)]:
            template = template[token]
        template["metadata"]["annotations"] = {"cdi.k8s.io/gpu": "nvidia.com/gpu=all"}
        del wrapped["metadata"]
    assert cond(wrapped, kind)


@pytest.mark.parametrize("resource", DIALECT_ONLY)
def test_dialect_resources_are_sent_only_where_dialects_are_enabled(resource: str) -> None:
    obj = pod(containers=[container({resource: "1"})])
    assert not _condition(_mutating("default"))(obj)
    assert _condition(_mutating("dialects"))(obj)
    assert _condition(_mutating("dialects"))(wrap(obj, "CronJob"), "CronJob")
    assert not _condition(_mutating("dialects"))(pod(containers=[container({"cpu": "1"})]))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_conditions_tolerate_missing_and_empty_fields(overlay: str) -> None:
    """Errors would reject the request under failurePolicy Fail, so odd objects must evaluate."""
    odd: list[Obj] = [
        {"metadata": {}},
        {"spec": {}},
        {"spec": {"containers": []}},
        {"spec": {"containers": [{"name": "a"}]}},
        {"spec": {"containers": [{"name": "a", "resources": {}}]}},
        {"spec": {"containers": [{"name": "a", "resources": {"limits": {}}, "env": []}]}},
        {"spec": {"containers": [{"name": "a", "env": [{"value": "x"}]}]}},
        {"spec": {"template": {}}},
        {"spec": {"template": {"spec": {}}}},
        {"spec": {"jobTemplate": {"spec": {}}}},
        {"spec": {"jobTemplate": {"spec": {"template": {"metadata": {}}}}}},
    ]
    for hook in (_mutating(overlay), _validating(overlay)):
        cond = _condition(hook)
        for obj in odd:
            assert cond(obj) is False, (hook["name"], obj)


def test_quota_condition_sends_canonical_pods_only() -> None:
    cond = _condition(_validating())
    canonical = {"fracgpu.io/core": "30", "fracgpu.io/memory": "32"}
    assert cond(pod(containers=[container(canonical, canonical)]))
    assert cond(pod(init=[container(canonical)]))
    assert not cond(pod(containers=[container({"cpu": "1"})]))
    assert not cond(pod(containers=[container(env=[{"name": VISIBLE_DEVICES, "value": "0"}])]))


@pytest.mark.parametrize(
    "limits",
    [
        pytest.param({"fracgpu.io/gpu": "0.5"}, id="a share"),
        pytest.param(
            {"fracgpu.io/gpu": "0.3", "fracgpu.io/gpumem": "4Gi"}, id="a share with memory"
        ),
        pytest.param({"fracgpu.io/gpumem": "8Gi"}, id="memory only"),
        pytest.param({"fracgpu.io/gpu": "2"}, id="two whole cards"),
    ],
)
@pytest.mark.parametrize("overlay", ["default", "dra"])
def test_quota_condition_sends_gpu_pods_as_the_mutating_webhook_left_them(
    overlay: str, limits: Obj
) -> None:
    """kube-apiserver evaluates a validating webhook's conditions on the object after every
    mutation; in DRA mode the mutation has replaced the fracgpu.io/ keys with claims, and a
    condition on the keys alone would never call the quota webhook (seen on a real 1.36 server)."""
    from webhook.gpumodels import GpuModel

    config = AdmissionConfig(allocation="dra")
    mutator = Mutator(
        config,
        Inventory({"Tesla T4": 15360}),
        claim_models=lambda: {"Tesla T4": GpuModel("Tesla T4", 15360)},
    )
    made = pod(containers=[container(limits)])
    outcome = mutator.mutate(made, "", "Pod")
    assert outcome.allowed, outcome.errors
    mutated = jsonpatch.apply_patch(made, outcome.patch)
    assert mutated["spec"].get("resourceClaims"), "the DRA mutation names a claim"
    assert _condition(_validating(overlay))(mutated)


def test_quota_condition_sends_pods_with_hand_written_claims() -> None:
    made = pod()
    made["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "mine"}]
    assert _condition(_validating())(made)


# The resource names and env vars a generated pod may use: the webhook's own, the dialects',
# ordinary ones, and look-alikes that must not be mistaken for ours.
_KEYS = [*ALWAYS, *DIALECT_ONLY, "cpu", "memory", "nvidia.com/mig-1g.5gb", "example.com/fracgpu.io"]
_VALUES = ["0", "1", "0.5", "300m", "2", "8Gi", "3000", "50", "1.5", "x"]
_ENV = [VISIBLE_DEVICES, "FRACGPU_GPU", "PATH", "CUDA_VISIBLE_DEVICES"]
_containers = st.lists(
    st.builds(
        container,
        limits=st.none()
        | st.dictionaries(st.sampled_from(_KEYS), st.sampled_from(_VALUES), max_size=3),
        requests=st.none()
        | st.dictionaries(st.sampled_from(_KEYS), st.sampled_from(_VALUES), max_size=2),
        env=st.none()
        | st.lists(
            st.builds(
                lambda n, v: {"name": n, "value": v},
                st.sampled_from(_ENV),
                st.sampled_from(["", "all", "0", "void"]),
            ),
            max_size=2,
        ),
        mounts=st.none()
        | st.lists(
            st.sampled_from(
                [
                    "/data",
                    "/var/run/nvidia-container-devices/all",
                    "/run/nvidia-container-devices/0",
                    "/run/fracgpu",
                    "/etc/ld.so.preload",
                ]
            ),
            max_size=2,
        ),
    ),
    min_size=1,
    max_size=3,
)
_annotations = st.none() | st.dictionaries(
    st.sampled_from(["cdi.k8s.io/gpu", "fracgpu.io/unlimited", "example.com/a"]),
    st.just("x"),
    max_size=2,
)


@pytest.mark.parametrize("overlay", ["default", "dialects"])
@settings(max_examples=100, deadline=None)
@given(
    containers=_containers,
    init=st.none() | _containers,
    extras=st.tuples(st.none() | _containers, _annotations),
    kind=st.sampled_from(sorted({k for _, k in TEMPLATE_PATHS})),
)
def test_what_the_condition_skips_the_webhook_would_pass_unchanged(
    overlay: str,
    containers: list[Obj],
    init: list[Obj] | None,
    extras: tuple[list[Obj] | None, Obj | None],
    kind: str,
) -> None:
    ephemeral, annotations = extras
    dialects = config_dialects(overlay)
    mutator = Mutator(AdmissionConfig(dialects=dialects), Inventory({"Tesla T4": 15360}))
    cond = _condition(_mutating(overlay))
    made = pod(containers=containers, init=init)
    if ephemeral is not None:
        made["spec"]["ephemeralContainers"] = ephemeral
    if annotations is not None:
        made["metadata"]["annotations"] = annotations
    obj = wrap(made, kind)
    if kind != "Pod" and annotations is not None:
        template: Obj = obj
        for token in TEMPLATE_PATHS[next((g, k) for g, k in TEMPLATE_PATHS if k == kind)]:
            template = template[token]
        template["metadata"]["annotations"] = annotations
    if cond(obj, kind):
        return
    group = next(g for g, k in TEMPLATE_PATHS if k == kind)
    outcome = mutator.mutate(obj, group, kind)
    assert outcome.allowed, (
        f"the webhook would have denied this {kind}, but matchConditions skip it: {outcome.errors}"
    )
    assert outcome.patch == [], (
        f"the webhook would have changed this {kind}, but matchConditions skip it: {outcome.patch}"
    )


def config_dialects(overlay: str) -> list[Dialect]:
    from tests.deploy_render import config_of

    return [Dialect(d) for d in config_of(render(overlay))["admission"].get("dialects", [])]


def test_certs_defaults_name_the_deployed_webhook_configurations() -> None:
    from certs.config import CertsConfig

    rendered = {
        (o["kind"], o["metadata"]["name"])
        for o in render("default")
        if o["kind"].endswith("WebhookConfiguration")
    }
    defaults = CertsConfig()
    assert rendered == {
        ("MutatingWebhookConfiguration", defaults.mutating_webhook_configurations[0]),
        ("ValidatingWebhookConfiguration", defaults.validating_webhook_configurations[0]),
    }
