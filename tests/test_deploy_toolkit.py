"""The node check that the NVIDIA container toolkit takes cards only from the device plugin's
device list: the shipped script run with /bin/sh on sample configurations, and its wiring."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from core import contract
from tests.deploy_render import find, of_kind, render

SCRIPT = Path(__file__).parent.parent / "deploy" / "base" / "check-nvidia-toolkit.sh"
SAFE = (
    "accept-nvidia-visible-devices-envvar-when-unprivileged = false\n"
    "accept-nvidia-visible-devices-as-volume-mounts = true\n"
)


def check(
    tmp_path: Path, config: str | None, require: str = "true"
) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "config.toml"
    if config is not None:
        path.write_text(config)
    return subprocess.run(
        ["/bin/sh", str(SCRIPT)],
        env={"TOOLKIT_CONFIG": str(path), "REQUIRE": require, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
        timeout=10,
    )


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(SAFE, id="both-set"),
        pytest.param(
            "#comment\naccept-nvidia-visible-devices-envvar-when-unprivileged=false # no\n"
            'accept-nvidia-visible-devices-as-volume-mounts = "true"\n'
            "[nvidia-container-cli]\nenvironment = []\n",
            id="compact-quoted-then-a-table",
        ),
        pytest.param(
            "accept-nvidia-visible-devices-envvar-when-unprivileged = true\n" + SAFE,
            id="last-assignment-wins",
        ),
        pytest.param(SAFE.rstrip("\n"), id="no-final-newline"),
    ],
)
def test_safe_configurations_pass(tmp_path: Path, config: str) -> None:
    assert check(tmp_path, config).returncode == 0


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        pytest.param(None, "cannot read", id="missing"),
        pytest.param("", "envvar-when-unprivileged = true", id="defaults"),
        pytest.param(
            "accept-nvidia-visible-devices-as-volume-mounts = true\n",
            "envvar-when-unprivileged = true",
            id="envvar-left-at-its-default",
        ),
        pytest.param(
            "accept-nvidia-visible-devices-envvar-when-unprivileged = false\n",
            "as-volume-mounts = false",
            id="mounts-left-at-their-default",
        ),
        pytest.param(
            "[nvidia-container-runtime]\n" + SAFE,
            "envvar-when-unprivileged = true",
            id="inside-a-table-is-another-key",
        ),
        pytest.param(
            "#accept-nvidia-visible-devices-envvar-when-unprivileged = false\n"
            "accept-nvidia-visible-devices-as-volume-mounts = true\n",
            "envvar-when-unprivileged = true",
            id="commented-out",
        ),
    ],
)
def test_unsafe_configurations_stop_the_plugin_and_say_why(
    tmp_path: Path, config: str | None, reason: str
) -> None:
    result = check(tmp_path, config)
    assert result.returncode == 1
    assert reason in result.stderr
    assert "accept-nvidia-visible-devices-as-volume-mounts = true" in result.stderr


def test_require_false_only_warns(tmp_path: Path) -> None:
    result = check(tmp_path, "", require="false")
    assert result.returncode == 0
    assert "REQUIRE=false: starting anyway" in result.stderr


def _plugin_spec() -> Any:
    return find(render("default"), "DaemonSet", "fracgpu-device-plugin")["spec"]["template"]["spec"]


def test_the_daemonset_runs_the_shipped_script_first() -> None:
    spec = _plugin_spec()
    assert spec["initContainers"][0]["name"] == "check-nvidia-toolkit"
    (cm,) = [
        o
        for o in of_kind(render("default"), "ConfigMap")
        if o["metadata"]["name"].startswith("fracgpu-node-checks")
    ]
    assert cm["data"]["check-nvidia-toolkit.sh"] == SCRIPT.read_text()


def test_the_script_reads_the_hosts_toolkit_configuration() -> None:
    spec = _plugin_spec()
    init = spec["initContainers"][0]
    env = {e["name"]: e["value"] for e in init["env"]}
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    host_dir = volumes["toolkit-config"]["hostPath"]["path"]
    assert env["TOOLKIT_CONFIG"] == f"{mounts['toolkit-config']}/config.toml"
    assert host_dir == "/etc/nvidia-container-runtime"
    assert init["command"][-1] == f"{mounts['checks']}/{SCRIPT.name}"


def test_the_plugin_names_all_cards_the_way_the_configured_toolkit_reads() -> None:
    spec = _plugin_spec()
    (plugin,) = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    (mount,) = [
        m
        for m in plugin["volumeMounts"]
        if m["mountPath"].startswith(contract.DEVICE_LIST_MOUNT_ROOT)
    ]
    assert mount["mountPath"] == f"{contract.DEVICE_LIST_MOUNT_ROOT}/all"
    assert volumes[mount["name"]]["hostPath"]["path"] == contract.DEVICE_LIST_HOST_PATH


def test_script_parses_as_posix_sh() -> None:
    assert subprocess.run(["/bin/sh", "-n", str(SCRIPT)], check=False).returncode == 0
