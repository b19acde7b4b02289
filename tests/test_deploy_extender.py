"""deploy/overlays/default: device-plugin mode with the card chosen by the scheduler extender,
what fracgpu installs by default.

The overlay is the base (deploy/overlays/node-placement, the device plugin choosing at kubelet
admission) plus these things, and nothing else may drift: serve's config serves the extender on
its own port and sends GPU pods to fracgpu-scheduler; that profile calls it there
(``ignorable: false``, ``nodeCacheCapable``, both canonical resources, bind) with the client
certificate serve issues into its Secret, which the scheduler mounts; the webhook's Deployment
and Service expose the port; serve may keep that Secret; the device plugin runs with
``--placement=extender``. The CRD and the rest of RBAC come from the base
(tests/test_deploy_rbac.py lists the grants). The Helm chart renders the same with its default
values in device-plugin mode, and node-placement with ``placement: node``
(tests/test_deploy_helm.py).
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml

from extender.service import BIND_PATH, FILTER_PATH, PRIORITIZE_PATH, ExtenderConfig
from fracgpu.serve import ServeConfig
from tests.deploy_render import config_of, find, grants_of, of_kind, render
from tests.test_deploy_manifests import SUPPORTED_VERSIONS
from tests.test_deploy_rbac import SA_WEBHOOK, WEBHOOK_CORE, WEBHOOK_OWN_CERTS, _all

OVERLAY = "default"
BASE = "node-placement"  # deploy/base as it is


def scheduler_config(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (cm,) = [
        o
        for o in of_kind(objs, "ConfigMap")
        if o["metadata"]["name"].startswith("fracgpu-scheduler-config")
    ]
    data: dict[str, Any] = yaml.safe_load(cm["data"]["config.yaml"])
    return data


def test_serve_config_differs_from_the_base_only_where_it_must() -> None:
    base, ours = config_of(render(BASE)), config_of(render(OVERLAY))
    assert ours.pop("extender") == {
        "enabled": True,
        "policy": "pack",
        "port": 8444,
        "client_secret_name": "fracgpu-scheduler-client-tls",
    }
    assert ours["admission"].pop("scheduler_name") == "fracgpu-scheduler"
    base["admission"].pop("scheduler_name")
    assert ours == base
    raw = config_of(render(OVERLAY))
    raw.pop("admission")  # read by the webhook's own loader, with its flags
    assert ServeConfig.model_validate(raw).extender == ExtenderConfig(enabled=True, port=8444)


def test_the_profile_calls_the_extender_as_the_memo_says() -> None:
    base, ours = scheduler_config(render(BASE)), scheduler_config(render(OVERLAY))
    (extender,) = ours.pop("extenders")
    assert ours == base
    prefix = extender["urlPrefix"]
    # The extender's own port (mutual TLS), never the admission port (443 -> 8443).
    assert prefix.startswith("https://fracgpu-webhook.fracgpu.svc:8444/")
    for verb, path in (("filterVerb", FILTER_PATH), ("prioritizeVerb", PRIORITIZE_PATH),
                       ("bindVerb", BIND_PATH)):  # fmt: skip
        assert f"{prefix.split(':8444', 1)[1]}/{extender[verb]}" == path
    assert extender["ignorable"] is False
    assert extender["nodeCacheCapable"] is True
    assert extender["enableHTTPS"] is True
    assert {r["name"]: r["ignoredByScheduler"] for r in extender["managedResources"]} == {
        "fracgpu.io/core": False,
        "fracgpu.io/memory": False,
    }
    assert extender["tlsConfig"]["serverName"] == "fracgpu-webhook.fracgpu.svc"


def test_the_scheduler_mounts_the_client_certificate_serve_issues() -> None:
    """certFile, keyFile and caFile are the keys of the Secret serve fills (named, so that the
    scheduler waits for them rather than start without), mounted nowhere inside another mount."""
    objs = render(OVERLAY)
    config = config_of(objs)
    tls = scheduler_config(objs)["extenders"][0]["tlsConfig"]
    files = [tls["certFile"], tls["keyFile"], tls["caFile"]]
    deployment = find(objs, "Deployment", "fracgpu-scheduler")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (mount,) = {
        m["name"]: m
        for f in files
        for m in container["volumeMounts"]
        if f.startswith(m["mountPath"] + "/")
    }.values()
    assert not any(
        m["mountPath"].startswith(mount["mountPath"] + "/")
        or mount["mountPath"].startswith(m["mountPath"] + "/")
        for m in container["volumeMounts"]
    ), "no mount inside another (a read-only ConfigMap volume cannot hold a mount point)"
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == config["extender"]["client_secret_name"]
    assert {i["key"]: i["path"] for i in volume["secret"]["items"]} == {
        "tls.crt": "tls.crt",
        "tls.key": "tls.key",
        "ca.crt": "ca.crt",
    }
    assert [f.rsplit("/", 1)[1] for f in files] == ["tls.crt", "tls.key", "ca.crt"]
    find(objs, "Secret", config["extender"]["client_secret_name"])  # created empty


def test_the_extender_port_is_exposed_where_the_scheduler_calls_it() -> None:
    objs = render(OVERLAY)
    port = config_of(objs)["extender"]["port"]
    webhook = find(objs, "Deployment", "fracgpu-webhook")
    (container,) = webhook["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"https": 8443, "extender": port}
    service = find(objs, "Service", "fracgpu-webhook")
    exposed = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
    assert exposed == {"https": (443, "https"), "extender": (port, "extender")}
    assert f":{port}/" in scheduler_config(objs)["extenders"][0]["urlPrefix"]


def test_serve_may_keep_the_client_secret_and_restart_the_scheduler_and_nothing_more() -> None:
    """The client Secret, and a patch of the scheduler's Deployment (its pod template stamp,
    when the CAs change: kube-scheduler reads its CA file only at start)."""
    grants, builtin = grants_of(render(OVERLAY), SA_WEBHOOK)
    client = _all(
        "fracgpu", "", "secrets", "get watch update patch", "fracgpu-scheduler-client-tls"
    )
    restart = _all("fracgpu", "apps", "deployments", "patch", "fracgpu-scheduler")
    assert grants == WEBHOOK_CORE | WEBHOOK_OWN_CERTS | client | restart
    assert builtin == set()


def test_the_device_plugin_places_by_the_record() -> None:
    daemonset = find(render(OVERLAY), "DaemonSet", "fracgpu-device-plugin")
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    assert "--placement=extender" in container["args"]


def test_the_ledger_crd_is_installed() -> None:
    names = [c["metadata"]["name"] for c in of_kind(render(OVERLAY), "CustomResourceDefinition")]
    assert "gpunodeledgers.fracgpu.io" in names


def test_node_placement_is_the_fallback_without_the_extender() -> None:
    """deploy/overlays/node-placement: the base as is; the device plugin picks each card at
    kubelet admission, nothing calls or serves the extender, GPU pods keep their scheduler."""
    objs = render(BASE)
    config = config_of(objs)
    assert "extender" not in config
    assert config["admission"]["scheduler_name"] == ""
    assert "extenders" not in scheduler_config(objs)
    daemonset = find(objs, "DaemonSet", "fracgpu-device-plugin")
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    assert not [a for a in container["args"] if a.startswith("--placement")]
    service = find(objs, "Service", "fracgpu-webhook")
    assert [p["name"] for p in service["spec"]["ports"]] == ["https"]
    assert [s["metadata"]["name"] for s in of_kind(objs, "Secret")] == ["fracgpu-webhook-tls"]


def test_cert_manager_issues_the_schedulers_client_certificate_from_the_webhooks_ca() -> None:
    """deploy/overlays/cert-manager places by the extender too: cert-manager issues the
    scheduler's client certificate (client auth only) into the Secret the scheduler mounts, from
    the Issuer of the serving certificate, whose CA serve trusts for client certificates
    (certs.ca_file); serve issues nothing and no Secret is created for it to fill."""
    objs = render("cert-manager")
    config = config_of(objs)
    assert config["certs"]["mode"] == "files"
    assert config["admission"]["scheduler_name"] == "fracgpu-scheduler"
    secret_name = config["extender"]["client_secret_name"]
    (client,) = [c for c in of_kind(objs, "Certificate") if c["spec"]["secretName"] == secret_name]
    serving = find(objs, "Certificate", "fracgpu-webhook")
    assert client["spec"]["issuerRef"] == serving["spec"]["issuerRef"]
    issuer = find(objs, "Issuer", client["spec"]["issuerRef"]["name"])
    assert "ca" in issuer["spec"]  # a CA Issuer: ca.crt in both Secrets is that CA
    assert "client auth" in client["spec"]["usages"]
    assert "server auth" not in client["spec"]["usages"]
    assert not client["spec"].get("isCA", False)
    assert client["spec"]["privateKey"]["rotationPolicy"] == "Always"
    pod = find(objs, "Deployment", "fracgpu-scheduler")["spec"]["template"]["spec"]
    mounted = [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v]
    assert mounted == [secret_name]
    assert of_kind(objs, "Secret") == []
    daemonset = find(objs, "DaemonSet", "fracgpu-device-plugin")
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    assert "--placement=extender" in container["args"]


def test_extender_config_defaults_are_off() -> None:
    assert ExtenderConfig().enabled is False


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS[-2:])
def test_every_object_validates_against_the_kubernetes_schema(version: str) -> None:
    for obj in render(OVERLAY):
        kubernetes_validate.validate(obj, version, strict=True)
