"""The node agents' common flags and settings: defined once, the same in both modes.

A flag both agents take belongs to ``shared.flags.add_node_flags``; a test here fails when one
agent grows a common flag the other lacks, or when both define the same flag on their own.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.classic import cli as classic_cli
from deviceplugin.dra import cli as dra_cli
from deviceplugin.shared.flags import add_node_flags
from deviceplugin.shared.settings import GuardSettings, NodeSettings, SettingsError

AGENTS = {"device-plugin": classic_cli, "dra-plugin": dra_cli}


def parser_of(command: str) -> argparse.ArgumentParser:
    root = argparse.ArgumentParser()
    AGENTS[command].add_parser(root.add_subparsers())
    sub = root._subparsers._group_actions[0]  # type: ignore[union-attr]
    parser: argparse.ArgumentParser = sub.choices[command]  # type: ignore[attr-defined]
    return parser


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings} - {"-h", "--help"}


def common_options() -> set[str]:
    parser = argparse.ArgumentParser()
    add_node_flags(parser, daemonset="x", metrics_port=1)
    return options(parser)


def test_every_common_flag_is_in_both_agents() -> None:
    common = common_options()
    for command in AGENTS:
        missing = common - options(parser_of(command))
        assert not missing, f"fracgpu {command} lacks the common flags {sorted(missing)}"


def test_a_flag_both_agents_take_is_defined_once() -> None:
    both = options(parser_of("device-plugin")) & options(parser_of("dra-plugin"))
    twice = both - common_options()
    assert not twice, f"{sorted(twice)}: in both agents; add them in shared.flags.add_node_flags"


def config(command: str, *argv: str) -> Any:
    root = argparse.ArgumentParser()
    AGENTS[command].add_parser(root.add_subparsers())
    args = root.parse_args([command, "--node-name", "n1", *argv])
    return AGENTS[command].config_from(args)


# Each common flag, set in either mode, lands in the same field with the same value.
COMMON_CASES = [
    pytest.param(("--health-quiet", "7"), "health_quiet_s", 7.0, id="health-quiet"),
    pytest.param(("--ignore-xids", "13,48"), "ignored_xids", frozenset({13, 48}), id="xids"),
    pytest.param(("--kubelet-root", "/k"), "kubelet_root", Path("/k"), id="kubelet-root"),
    pytest.param(
        ("--kubelet-root", "/k"), "podresources_path", Path("/k/pod-resources/kubelet.sock"),
        id="podresources-under-kubelet-root",
    ),
    pytest.param(
        ("--pod-resources-socket", "/p.sock"), "podresources_path", Path("/p.sock"),
        id="podresources-socket",
    ),
    pytest.param(("--host-root", "/h"), "host_root", Path("/h"), id="host-root"),
    pytest.param(("--dev-root", "/d"), "dev_root", Path("/d"), id="dev-root"),
    pytest.param(("--cdi-root", "/c"), "cdi_root", Path("/c"), id="cdi-root"),
    pytest.param(("--nvml-library", "/n.so"), "nvml_library", Path("/n.so"), id="nvml"),
    pytest.param(("--metrics-address", "127.0.0.1"), "metrics_address", "127.0.0.1", id="addr"),
    pytest.param(("--metrics-port", "0"), "metrics_port", 0, id="metrics-off"),
    pytest.param(("--kubeconfig", "/kc"), "kubeconfig", Path("/kc"), id="kubeconfig"),
    pytest.param(("--daemonset", "ns/ds"), "daemonset.name", "ds", id="daemonset"),
    pytest.param(("--daemonset", ""), "daemonset", None, id="no-daemonset"),
    pytest.param(("--guard-interval", "0"), "guard.interval_s", 0.0, id="guard-off"),
    pytest.param(("--no-guard-kill",), "guard.kill", False, id="guard-report-only"),
]  # fmt: skip


@pytest.mark.parametrize("command", list(AGENTS))
@pytest.mark.parametrize(("argv", "field", "expected"), COMMON_CASES)
def test_common_flags_mean_the_same_in_both_modes(
    command: str, argv: tuple[str, ...], field: str, expected: object
) -> None:
    value: object = config(command, *argv)
    for part in field.split("."):
        value = getattr(value, part)
    assert value == expected


@pytest.mark.parametrize(
    ("command", "port"), [("device-plugin", 9402), ("dra-plugin", 9403)]
)  # each agent its own port: both run on a node while a cluster switches modes
def test_metrics_port_defaults_per_agent(command: str, port: int) -> None:
    assert config(command).metrics_port == port


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(("--metrics-port", "70000"), "--metrics-port", id="port-out-of-range"),
        pytest.param(("--metrics-port", "x"), "--metrics-port", id="port-not-a-number"),
        pytest.param(("--health-quiet", "-1"), "--health-quiet", id="negative-quiet"),
        pytest.param(("--ignore-xids", "0"), "--ignore-xids", id="xid-zero"),
        pytest.param(("--daemonset", "nons"), "--daemonset", id="daemonset-without-namespace"),
    ],
)
@pytest.mark.parametrize("command", list(AGENTS))
def test_bad_common_flags_are_refused_in_both_modes(
    command: str, argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        config(command, *argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        pytest.param({"metrics_port": -1}, "metrics port -1", id="negative-port"),
        pytest.param({"metrics_port": 65536}, "metrics port 65536", id="port-too-high"),
        pytest.param({"ignored_xids": frozenset({-3})}, "positive", id="negative-xid"),
        pytest.param({"health_wait_ms": 0}, "health_wait_ms 0", id="no-wait"),
        pytest.param({"podresources_timeout_s": 0.0}, "podresources_timeout_s", id="timeout"),
        pytest.param({"health_quiet_s": float("nan")}, "health_quiet_s", id="nan-quiet"),
        pytest.param({"uninstall_timeout_s": -1.0}, "uninstall_timeout_s", id="uninstall"),
    ],
)
def test_settings_are_validated_once_at_construction(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        NodeSettings(**fields)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        pytest.param({"interval_s": -0.5}, "guard interval_s", id="negative-interval"),
        pytest.param({"grace_s": float("nan")}, "guard grace_s", id="nan-grace"),
        pytest.param({"process_overhead_mib": -1}, "process_overhead_mib", id="negative-mib"),
    ],
)
def test_guard_settings_are_validated(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        GuardSettings(**fields)


def test_the_dra_plugin_needs_a_node_name(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    root = argparse.ArgumentParser()
    dra_cli.add_parser(root.add_subparsers())
    with pytest.raises(SystemExit, match="no node name"):
        dra_cli.config_from(root.parse_args(["dra-plugin"]))


def test_the_device_plugin_dir_follows_the_kubelet_root() -> None:
    assert config("device-plugin", "--kubelet-root", "/k").plugin_dir == Path("/k/device-plugins")
    assert config("device-plugin", "--plugin-dir", "/p").plugin_dir == Path("/p")


def test_no_cdi_is_the_device_plugins_own() -> None:
    assert config("device-plugin", "--no-cdi").cdi_root is None
