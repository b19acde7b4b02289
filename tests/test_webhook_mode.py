"""Which mode to install in and which mode to admit in: decided from the cluster (the fake API
server for what it serves and holds), and an operator's explicit choice kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from core import dra
from core.kube import DEVICE_CLASSES, KubeError, call_json, kube_client
from testkit.apiserver import FakeApiServer
from webhook.mode import Cluster, ModeError, admitting, read_cluster, resolve, to_install


@pytest.mark.parametrize(
    ("cluster", "install", "admit"),
    [
        pytest.param(Cluster((1, 37), True, True), "dra", "dra", id="1.37-dra-installed"),
        pytest.param(
            Cluster((1, 36), True, False), "dra", "device-plugin", id="1.36-plugin-installed"
        ),
        pytest.param(Cluster((1, 35), True, False), "device-plugin", "device-plugin", id="1.35"),
        pytest.param(
            Cluster((1, 33), False, False), "device-plugin", "device-plugin", id="no-dra-api"
        ),
        pytest.param(Cluster(None, True, False), "device-plugin", "device-plugin", id="no-version"),
        pytest.param(
            Cluster((1, 35), True, True), "device-plugin", "dra", id="dra-installed-too-old"
        ),
    ],
)
def test_the_modes_a_cluster_gets(cluster: Cluster, install: str, admit: str) -> None:
    assert to_install(cluster).allocation == install
    assert admitting(cluster).allocation == admit


def test_an_older_cluster_with_the_dra_overlay_is_told_it_is_too_old() -> None:
    assert "older than the 1.36" in admitting(Cluster((1, 35), True, True)).why


def test_a_cluster_that_could_run_dra_says_how_to_move() -> None:
    assert "deploy/overlays/dra" in admitting(Cluster((1, 37), True, False)).why


@pytest.mark.parametrize("configured", ["dra", "device-plugin"])
async def test_an_operators_choice_is_kept(configured: str) -> None:
    mode = await resolve(configured, None)
    assert (mode.allocation, mode.why) == (
        configured,
        "set in the configuration (admission.allocation)",
    )


async def test_standalone_is_device_plugin_mode() -> None:
    assert (await resolve("auto", None)).allocation == "device-plugin"


async def test_auto_follows_the_device_class(tmp_path: Path) -> None:
    async with FakeApiServer() as fake, kube_client(fake.kubeconfig(tmp_path / "k")) as api:
        before = await read_cluster(api)
        assert (before.version, before.serves_dra, before.device_class) == ((1, 36), True, False)
        assert (await resolve("auto", api)).allocation == "device-plugin"
        device_class = {
            "apiVersion": dra.API_VERSION,
            "kind": "DeviceClass",
            "metadata": {"name": dra.DEVICE_CLASS},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{dra.DRIVER}"'}}]},
        }
        await call_json(api, "POST", DEVICE_CLASSES.path(), body=device_class)
        mode = await resolve("auto", api)
        assert mode.allocation == "dra"
        assert f"DeviceClass {dra.DEVICE_CLASS} is installed" in mode.why


async def test_a_refusal_to_read_the_device_class_says_how_to_fix() -> None:
    async def refused(api: object, method: str, path: str, **_: object) -> object:
        raise KubeError(403, "Forbidden", f"cannot get {path}")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("webhook.mode.call_json", refused)
        with pytest.raises(ModeError, match="grant get on it"):
            await resolve("auto", object())


async def test_an_api_server_that_never_answers_stops_the_start_with_the_fix() -> None:
    async def down(api: object, method: str, path: str, **_: object) -> object:
        raise OSError("connection refused")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("webhook.mode.call_json", down)
        with pytest.raises(ModeError, match=r"set admission\.allocation to dra or device-plugin"):
            await resolve("auto", object(), within_s=0)
