"""deploy/helm/fracgpu: the Helm chart renders what the kustomize overlays render, value for
value, so that every test of the overlays (RBAC, CEL, schemas, host paths) holds for the chart
too; its values are typed and documented; helm lints it.

Equal means: the same objects (kind, name, namespace), each the same after removing what only
one of the two tools adds: Helm's own labels and the pods' checksum annotations, kustomize's
hash suffix on generated ConfigMap names, and the fracgpu Namespace (kustomize creates it; with
Helm the release namespace is created by `helm install --create-namespace`). ConfigMap files are
compared parsed (their comments differ), and text is compared with runs of whitespace as one
space (YAML folding puts line breaks in CEL expressions at other places).
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from typing import Any

import kubernetes_validate
import pytest
import yaml

from fracgpu.serve import ServeConfig
from tests.deploy_render import (
    CHART,
    DEPLOY,
    config_of,
    find,
    helm_run,
    render,
    render_chart,
    template_args,
)

Obj = dict[str, Any]

HELM_LABELS = frozenset(
    {
        "helm.sh/chart",
        "app.kubernetes.io/managed-by",
        "app.kubernetes.io/instance",
        "app.kubernetes.io/version",
    }
)
GENERATED = re.compile(
    r"^(fracgpu-config|fracgpu-scheduler-config|fracgpu-node-checks)-[a-z0-9]{10}$"
)
DRA_APIS = ("resource.k8s.io/v1/DeviceClass",)


def _text(value: str) -> str:
    return " ".join(GENERATED.sub(r"\1", value).split())


def _normal(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_normal(v) for v in value]
    if isinstance(value, str):
        return _text(value)
    return value


def _strip_meta(meta: Obj) -> None:
    labels = {k: v for k, v in (meta.get("labels") or {}).items() if k not in HELM_LABELS}
    annotations = {
        k: v for k, v in (meta.get("annotations") or {}).items() if not k.startswith("checksum/")
    }
    meta.pop("labels", None)
    meta.pop("annotations", None)
    if labels:
        meta["labels"] = labels
    if annotations:
        meta["annotations"] = annotations


def comparable(objs: list[Obj]) -> dict[tuple[str, str, str], Any]:
    """The objects keyed by (kind, namespace, name), with what only one tool adds removed."""
    out: dict[tuple[str, str, str], Any] = {}
    for original in objs:
        if original["kind"] == "Namespace":
            continue
        obj = copy.deepcopy(original)
        _strip_meta(obj["metadata"])
        template = (obj.get("spec") or {}).get("template")
        if isinstance(template, dict) and "metadata" in template:
            _strip_meta(template["metadata"])
        if obj["kind"] == "ConfigMap":
            obj["data"] = {
                key: yaml.safe_load(text) if key.endswith(".yaml") else text
                for key, text in obj["data"].items()
            }
        meta = obj["metadata"]
        key = (obj["kind"], meta.get("namespace", ""), GENERATED.sub(r"\1", meta["name"]))
        assert key not in out, f"{key} twice"
        out[key] = _normal(obj)
    return out


def is_hook(obj: Obj) -> bool:
    """A Helm hook (the post-delete node cleanup): kustomize has none to compare it with."""
    return "helm.sh/hook" in (obj.get("metadata", {}).get("annotations") or {})


def _differences(chart: list[Obj], overlay: list[Obj]) -> list[str]:
    mine, theirs = comparable([o for o in chart if not is_hook(o)]), comparable(overlay)
    problems = [f"only in the chart: {k}" for k in sorted(mine.keys() - theirs.keys())]
    problems += [f"only in the overlay: {k}" for k in sorted(theirs.keys() - mine.keys())]
    for key in sorted(mine.keys() & theirs.keys()):
        if mine[key] != theirs[key]:
            problems.append(
                f"{key} differs:\n chart:   {json.dumps(mine[key], sort_keys=True)}\n"
                f" overlay: {json.dumps(theirs[key], sort_keys=True)}"
            )
    return problems


@dataclass(frozen=True)
class Equivalent:
    overlay: str
    values: Obj = field(default_factory=dict)
    kube: str = "1.35.0"
    apis: tuple[str, ...] = ()


EQUIVALENTS = [
    pytest.param(Equivalent("default"), id="defaults-before-1.36-are-the-device-plugin"),
    pytest.param(
        Equivalent("dra", kube="1.37.0", apis=DRA_APIS), id="defaults-on-1.37-with-dra-are-dra"
    ),
    pytest.param(Equivalent("default", kube="1.37.0"), id="1.37-without-resource-v1-stays-dp"),
    pytest.param(Equivalent("dra", {"mode": "dra"}), id="mode-dra"),
    pytest.param(
        Equivalent("default", {"mode": "device-plugin"}, kube="1.37.0", apis=DRA_APIS),
        id="mode-device-plugin-on-a-dra-cluster",
    ),
    pytest.param(
        Equivalent("cert-manager", {"certs": {"mode": "cert-manager"}}), id="cert-manager"
    ),
    pytest.param(
        Equivalent(
            "network-policy",
            {"networkPolicy": {"enabled": True, "apiServerCIDRs": ["192.0.2.0/24"]}},
        ),
        id="network-policy",
    ),
    pytest.param(Equivalent("dialects", {"dialects": ["hami", "tkestack"]}), id="dialects"),
    pytest.param(
        Equivalent("default", {"placement": "extender"}),
        id="explicit-extender-placement-is-the-default",
    ),
    pytest.param(Equivalent("node-placement", {"placement": "node"}), id="node-placement"),
    pytest.param(
        Equivalent("dra", {"placement": "node"}, kube="1.37.0", apis=DRA_APIS),
        id="node-placement-changes-nothing-in-dra-mode",
    ),
]


@pytest.mark.parametrize("case", EQUIVALENTS)
def test_the_chart_renders_what_the_overlay_does(case: Equivalent) -> None:
    chart = render_chart(case.values, kube=case.kube, apis=case.apis)
    assert _differences(chart, render(case.overlay)) == []


def test_the_comparison_sees_a_difference() -> None:
    """The comparison is not blind: a value the overlay does not have is found."""
    chart = render_chart({"webhook": {"replicas": 3}})
    problems = _differences(chart, render("default"))
    assert len(problems) == 1
    assert problems[0].startswith("('Deployment', 'fracgpu', 'fracgpu-webhook') differs")


def test_helm_lints_the_chart() -> None:
    proc = helm_run("lint", str(CHART), "--kube-version", "1.35.0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


def test_the_crd_and_the_node_checks_are_the_kustomize_files() -> None:
    """One copy of each: the chart links to deploy/crds and deploy/base (helm follows links, and
    `helm package` stores the content)."""
    assert (CHART / "crds" / "gpuquota.yaml").resolve() == DEPLOY / "crds" / "gpuquota.yaml"
    checks = CHART / "files" / "check-nvidia-toolkit.sh"
    assert checks.resolve() == DEPLOY / "base" / "check-nvidia-toolkit.sh"


# --- values ------------------------------------------------------------------------------------


def _schema() -> Obj:
    schema: Obj = json.loads((CHART / "values.schema.json").read_text())
    return schema


def _resolve(schema: Obj, node: Obj) -> Obj:
    ref = node.get("$ref")
    if ref:
        resolved: Obj = schema["$defs"][ref.rsplit("/", 1)[1]]
        return resolved
    return node


def _walk(schema: Obj, node: Obj, values: Any, path: str) -> list[str]:
    """Every values.yaml key that the schema does not type, or whose default it misstates."""
    node = _resolve(schema, node)
    problems = []
    if "default" in node and node["default"] != values:
        problems.append(f"{path}: default {node['default']!r} in the schema, {values!r} in values")
    if isinstance(values, dict) and node.get("type") == "object" and "properties" in node:
        for key, value in values.items():
            if key not in node["properties"]:
                problems.append(f"{path}.{key}: not in the schema")
                continue
            problems += _walk(schema, node["properties"][key], value, f"{path}.{key}")
    elif "type" not in node:
        problems.append(f"{path}: no type")
    return problems


def test_every_value_is_typed_and_its_default_stated() -> None:
    schema = _schema()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert _walk(schema, schema, values, "") == []
    # and every top-level key the schema has is set in values.yaml (documented there)
    assert set(schema["properties"]) == set(values)


@pytest.mark.parametrize(
    ("values", "error"),
    [
        pytest.param({"mode": "mig"}, "at '/mode': value must be one of", id="unknown-mode"),
        pytest.param({"webhook": {"replica": 3}}, "'replica' not allowed", id="misspelled-key"),
        pytest.param({"webhook": {"replicas": 0}}, "at '/webhook/replicas'", id="no-replicas"),
        pytest.param({"dialects": ["volcano"]}, "at '/dialects/0'", id="unknown-dialect"),
        pytest.param({"certs": {"mode": "vault"}}, "at '/certs/mode'", id="unknown-certs-mode"),
        pytest.param(
            {"networkPolicy": {"enabled": True}},
            "networkPolicy.enabled needs networkPolicy.apiServerCIDRs",
            id="network-policy-without-cidrs",
        ),
        pytest.param(
            {"webhook": {"timeoutSeconds": 3}},
            "at '/webhook/timeoutSeconds'",
            id="too-short-for-a-new-quota-count",
        ),
        pytest.param(
            {"networkPolicy": {"enabled": True, "apiServerCIDRs": ["10.0.0.1"]}},
            "at '/networkPolicy/apiServerCIDRs/0'",
            id="cidr-without-prefix",
        ),
        pytest.param(
            {"placement": "scheduler"},
            "at '/placement'",
            id="unknown-placement",
        ),
        pytest.param(
            {"placement": "extender", "scheduler": {"enabled": False}},
            "set scheduler.enabled: true, or placement: node",
            id="extender-placement-without-the-scheduler",
        ),
        pytest.param(
            {"scheduler": {"enabled": False}},
            "set scheduler.enabled: true, or placement: node",
            id="device-plugin-mode-without-the-scheduler",
        ),
        pytest.param(
            {"placement": "extender", "mode": "dra"},
            "placement extender is for device-plugin mode",
            id="extender-placement-in-dra-mode",
        ),
    ],
)
def test_bad_values_are_refused_with_the_key(values: Obj, error: str) -> None:
    proc = helm_run(*template_args(values))
    assert proc.returncode != 0
    assert error in proc.stderr


@pytest.mark.parametrize(
    ("values", "kube", "apis"),
    [
        pytest.param({}, "1.35.0", (), id="device-plugin"),
        pytest.param({}, "1.37.0", DRA_APIS, id="dra"),
        pytest.param({"certs": {"mode": "cert-manager"}}, "1.35.0", (), id="cert-manager"),
        pytest.param({"webhook": {"timeoutSeconds": 4}}, "1.35.0", (), id="shortest-timeout"),
        pytest.param({"webhook": {"timeoutSeconds": 30}}, "1.35.0", (), id="longest-timeout"),
        pytest.param({"placement": "node"}, "1.35.0", (), id="node-placement"),
        pytest.param(
            {"config": {"quota": {"require_quota": True}, "admission": {"scheduler_name": "x"}}},
            "1.35.0",
            (),
            id="config-overrides",
        ),
    ],
)
def test_the_webhook_config_is_one_fracgpu_serve_accepts(
    values: Obj, kube: str, apis: tuple[str, ...]
) -> None:
    config = config_of(render_chart(values, kube=kube, apis=apis))
    ServeConfig.model_validate(config)
    for key, section in (values.get("config") or {}).items():
        for name, value in section.items():
            assert config[key][name] == value


def test_a_config_change_rolls_the_webhook() -> None:
    def checksum(values: Obj) -> str:
        deployment = find(render_chart(values), "Deployment", "fracgpu-webhook")
        annotation: str = deployment["spec"]["template"]["metadata"]["annotations"][
            "checksum/config"
        ]
        return annotation

    assert checksum({}) != checksum({"config": {"quota": {"require_quota": True}}})
    assert checksum({}) == checksum({"webhook": {"replicas": 3}})


def test_another_release_namespace_is_used_everywhere() -> None:
    """Installed into another namespace, nothing names fracgpu's: the service the webhook
    configurations call, the subjects, the policies' usernames, the certificate's names."""
    objs = render_chart(
        {"certs": {"mode": "cert-manager"}, "mode": "device-plugin"}, namespace="gpu-system"
    )
    text = yaml.safe_dump_all(objs)
    assert re.findall(r"\bfracgpu\.svc|:fracgpu:|namespace: fracgpu\b|fracgpu/fracgpu", text) == []
    for obj in objs:
        namespace = obj["metadata"].get("namespace")
        assert namespace in (None, "gpu-system", "kube-system"), obj["metadata"]
    assert config_of(objs)["certs"]["namespace"] == "gpu-system"


def test_one_replica_has_no_disruption_budget() -> None:
    """A budget of one available replica out of one blocks every node drain."""
    kinds = {o["kind"] for o in render_chart({"webhook": {"replicas": 1}})}
    assert "PodDisruptionBudget" not in kinds


@pytest.mark.parametrize(
    ("values", "kube", "apis"),
    [
        pytest.param({"placement": "node"}, "1.35.0", (), id="node-placement"),
        pytest.param({}, "1.37.0", DRA_APIS, id="dra"),
    ],
)
def test_the_scheduler_profile_can_be_left_out(
    values: Obj, kube: str, apis: tuple[str, ...]
) -> None:
    """Where nothing sends GPU pods to it: node placement, and DRA mode."""
    objs = render_chart({**values, "scheduler": {"enabled": False}}, kube=kube, apis=apis)
    names = {o["metadata"]["name"] for o in objs}
    assert not [n for n in names if n.startswith("fracgpu-scheduler")]
    assert "extender" not in config_of(objs)


@pytest.mark.parametrize(
    ("values", "extender"),
    [
        pytest.param({}, True, id="default"),
        pytest.param({"placement": "extender"}, True, id="extender"),
        pytest.param({"certs": {"mode": "cert-manager"}}, True, id="cert-manager"),
        pytest.param({"placement": "node"}, False, id="node"),
        pytest.param({"mode": "dra"}, False, id="dra"),
    ],
)
def test_the_scheduler_reaches_the_extender_through_the_network_policy(
    values: Obj, extender: bool
) -> None:
    """With a NetworkPolicy, the fracgpu-scheduler's pods reach the extender's port wherever
    it is served, and nobody reaches that port where it is not."""
    policy_values = {"networkPolicy": {"enabled": True, "apiServerCIDRs": ["192.0.2.0/24"]}}
    objs = render_chart({**values, **policy_values})
    policy = find(objs, "NetworkPolicy", "fracgpu-webhook")
    allowed = [
        (rule["from"], [p["port"] for p in rule["ports"]]) for rule in policy["spec"]["ingress"]
    ]
    scheduler = [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "fracgpu-scheduler"}}}]
    assert ((scheduler, [8444]) in allowed) is extender
    assert (8444 in [port for _, ports in allowed for port in ports]) is extender
    assert ("extender" in config_of(objs)) is extender


def test_cert_manager_issues_the_schedulers_client_certificate() -> None:
    """certs.mode cert-manager with extender placement: cert-manager issues the scheduler's
    client certificate from the CA that issues the serving certificate (serve trusts its
    mounted ca.crt for client certificates); nothing creates the Secret for serve to fill, and
    serve may touch no Secret."""
    objs = render_chart({"certs": {"mode": "cert-manager"}})
    client = find(objs, "Certificate", "fracgpu-scheduler-client")
    serving = find(objs, "Certificate", "fracgpu-webhook")
    assert client["spec"]["secretName"] == config_of(objs)["extender"]["client_secret_name"]
    issuer = {"kind": "Issuer", "name": "fracgpu-ca"}
    assert client["spec"]["issuerRef"] == serving["spec"]["issuerRef"] == issuer
    assert client["spec"]["usages"] == ["client auth", "digital signature"]
    assert [o for o in objs if o["kind"] == "Secret"] == []
    assert not [o for o in objs if o["kind"] == "Role" and "certs" in o["metadata"]["name"]]
    plain = render_chart({"certs": {"mode": "cert-manager"}, "placement": "node"})
    assert [o["metadata"]["name"] for o in plain if o["kind"] == "Certificate"] == [
        "fracgpu-ca",
        "fracgpu-webhook",
    ]


@pytest.mark.parametrize(
    ("kube", "values"),
    [
        ("1.30.0", {}),
        ("1.36.0", {}),
        ("1.37.0", {}),
        ("1.35.0", {"placement": "node"}),
    ],
)
def test_every_object_validates(kube: str, values: Obj) -> None:
    apis = DRA_APIS if kube >= "1.36" else ()
    for obj in render_chart(values, kube=kube, apis=apis):
        if obj["kind"] == "CustomResourceDefinition" or obj["apiVersion"].startswith("fracgpu.io"):
            continue
        try:
            kubernetes_validate.validate(obj, kube, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {exc.message} {list(exc.path)}")


def test_the_uninstall_hook_cleans_nodes_once_the_release_is_gone() -> None:
    """Only hook objects, run after the release's objects are deleted, removed once the Job
    succeeded; the Job runs fracgpu's image as non-root with the release's namespace."""
    hooks = [o for o in render_chart({}) if is_hook(o)]
    assert {o["kind"] for o in hooks} == {
        "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Job",
    }  # fmt: skip
    for obj in hooks:
        annotations = obj["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "post-delete"
        assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
    (job,) = [o for o in hooks if o["kind"] == "Job"]
    pod = job["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["containers"][0]["args"] == ["node-cleanup", "--namespace", "fracgpu"]
    weights = {o["kind"]: int(o["metadata"]["annotations"]["helm.sh/hook-weight"]) for o in hooks}
    assert weights["Job"] > max(w for k, w in weights.items() if k != "Job")
