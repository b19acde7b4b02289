"""deploy/overlays/extender: device-plugin mode with the card chosen by the scheduler extender.

The overlay is the default install plus three things, and nothing else may drift: serve's
config serves the extender and sends GPU pods to fracgpu-scheduler; that profile calls it
(``ignorable: false``, ``nodeCacheCapable``, both canonical resources, bind); the scheduler
trusts serve's CA; the device plugin runs with ``--placement=extender``. The CRD and RBAC come
from the base (tests/test_deploy_rbac.py lists the grants).
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml

from extender.service import BIND_PATH, FILTER_PATH, PRIORITIZE_PATH, ExtenderConfig
from fracgpu.serve import ServeConfig
from tests.deploy_render import config_of, find, of_kind, render
from tests.test_deploy_manifests import SUPPORTED_VERSIONS

OVERLAY = "extender"


def scheduler_config(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (cm,) = [
        o
        for o in of_kind(objs, "ConfigMap")
        if o["metadata"]["name"].startswith("fracgpu-scheduler-config")
    ]
    data: dict[str, Any] = yaml.safe_load(cm["data"]["config.yaml"])
    return data


def test_serve_config_differs_from_the_base_only_where_it_must() -> None:
    base, ours = config_of(render("default")), config_of(render(OVERLAY))
    assert ours.pop("extender") == {"enabled": True, "policy": "pack"}
    assert ours["admission"].pop("scheduler_name") == "fracgpu-scheduler"
    base["admission"].pop("scheduler_name")
    assert ours == base
    raw = config_of(render(OVERLAY))
    raw.pop("admission")  # read by the webhook's own loader, with its flags
    assert ServeConfig.model_validate(raw).extender == ExtenderConfig(enabled=True)


def test_the_profile_calls_the_extender_as_the_memo_says() -> None:
    base, ours = scheduler_config(render("default")), scheduler_config(render(OVERLAY))
    (extender,) = ours.pop("extenders")
    assert ours == base
    prefix = extender["urlPrefix"]
    assert prefix.startswith("https://fracgpu-webhook.fracgpu.svc/")
    for verb, path in (("filterVerb", FILTER_PATH), ("prioritizeVerb", PRIORITIZE_PATH),
                       ("bindVerb", BIND_PATH)):  # fmt: skip
        assert f"{prefix.split('.svc', 1)[1]}/{extender[verb]}" == path
    assert extender["ignorable"] is False
    assert extender["nodeCacheCapable"] is True
    assert extender["enableHTTPS"] is True
    assert {r["name"]: r["ignoredByScheduler"] for r in extender["managedResources"]} == {
        "fracgpu.io/core": False,
        "fracgpu.io/memory": False,
    }
    assert extender["tlsConfig"]["serverName"] == "fracgpu-webhook.fracgpu.svc"


def test_the_scheduler_mounts_the_ca_it_is_told_to_trust() -> None:
    objs = render(OVERLAY)
    ca_file = scheduler_config(objs)["extenders"][0]["tlsConfig"]["caFile"]
    deployment = find(objs, "Deployment", "fracgpu-scheduler")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (mount,) = [m for m in container["volumeMounts"] if ca_file.startswith(m["mountPath"] + "/")]
    assert not any(
        m["mountPath"].startswith(mount["mountPath"] + "/")
        or mount["mountPath"].startswith(m["mountPath"] + "/")
        for m in container["volumeMounts"]
    ), "no mount inside another (a read-only ConfigMap volume cannot hold a mount point)"
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    config = config_of(objs)
    assert volume["secret"]["secretName"] == config["certs"]["secret_name"]
    assert [i["path"] for i in volume["secret"]["items"]] == [ca_file.rsplit("/", 1)[1]]


def test_the_device_plugin_places_by_the_record() -> None:
    daemonset = find(render(OVERLAY), "DaemonSet", "fracgpu-device-plugin")
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    assert "--placement=extender" in container["args"]


def test_the_ledger_crd_is_installed() -> None:
    names = [c["metadata"]["name"] for c in of_kind(render(OVERLAY), "CustomResourceDefinition")]
    assert "gpunodeledgers.fracgpu.io" in names


def test_extender_config_defaults_are_off() -> None:
    assert ExtenderConfig().enabled is False


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS[-2:])
def test_every_object_validates_against_the_kubernetes_schema(version: str) -> None:
    for obj in render(OVERLAY):
        kubernetes_validate.validate(obj, version, strict=True)
