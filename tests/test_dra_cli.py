"""``fracgpu dra-plugin``: flags, their defaults, and a command that is imported only when run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from deviceplugin.dra.cli import add_parser, config_from


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["dra-plugin", *argv])


@pytest.mark.parametrize(
    ("attribute", "expected"),
    [
        pytest.param("driver_name", "gpu.fracgpu.io", id="driver"),
        pytest.param(
            "registry_socket",
            Path("/var/lib/kubelet/plugins_registry/gpu.fracgpu.io-reg.sock"),
            id="registration-socket",
        ),
        pytest.param(
            "service_socket",
            Path("/var/lib/kubelet/plugins/gpu.fracgpu.io/dra.sock"),
            id="service-socket",
        ),
        pytest.param(
            "checkpoint_path",
            Path("/var/lib/kubelet/plugins/gpu.fracgpu.io/checkpoint.json"),
            id="checkpoint",
        ),
        pytest.param("cdi_root", Path("/var/run/cdi"), id="cdi"),
        pytest.param("host_root", Path("/var/lib/fracgpu"), id="host-root"),
        pytest.param("kubeconfig", None, id="in-cluster"),
        pytest.param("pool_name", "node-a", id="pool-is-the-node"),
    ],
)
def test_defaults(monkeypatch: pytest.MonkeyPatch, attribute: str, expected: object) -> None:
    monkeypatch.setenv("NODE_NAME", "node-a")
    assert getattr(config_from(parse()), attribute) == expected


def test_options_follow_the_kubelet_root(tmp_path: Path) -> None:
    config = config_from(
        parse("--node-name", "n1", "--kubelet-root", str(tmp_path), "--driver-name", "x.example")
    )
    assert config.service_socket == tmp_path / "plugins" / "x.example" / "dra.sock"


@pytest.mark.parametrize(
    ("flag", "value", "attribute", "expected"),
    [
        pytest.param("--cdi-root", "/etc/cdi", "cdi_root", Path("/etc/cdi"), id="cdi-root"),
        pytest.param("--host-root", "/srv/fg", "host_root", Path("/srv/fg"), id="host-root"),
        pytest.param("--nvml-library", "/lib/x.so", "nvml_library", Path("/lib/x.so"), id="nvml"),
        pytest.param("--metrics-port", "0", "metrics_port", 0, id="metrics-off"),
        pytest.param("--kubeconfig", "/k", "kubeconfig", Path("/k"), id="kubeconfig"),
    ],
)
def test_options(flag: str, value: str, attribute: str, expected: object) -> None:
    config = config_from(parse("--node-name", "n1", flag, value))
    assert getattr(config, attribute) == expected


def test_no_node_name_says_how_to_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    with pytest.raises(SystemExit, match="pass --node-name or set NODE_NAME"):
        config_from(parse())


def test_the_command_is_deferred() -> None:
    sys.modules.pop("deviceplugin.dra.daemon", None)
    args = parse("--node-name", "n1")
    assert args.run.__qualname__ == "deferred(deviceplugin.dra.cli.run)"
    assert "deviceplugin.dra.daemon" not in sys.modules
