from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from deviceplugin.classic.cli import add_parser, config_from
from deviceplugin.shared.settings import GuardSettings


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["device-plugin", *argv])


def test_defaults_match_kubelet_and_the_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    config = config_from(parse())
    assert config.plugin_dir == Path("/var/lib/kubelet/device-plugins")
    assert config.podresources_path == Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    assert config.host_root == Path("/var/lib/fracgpu")
    assert config.core_resource == "fracgpu.io/core"
    assert config.memory_resource == "fracgpu.io/memory"
    assert config.ignored_xids == frozenset({13, 31, 43, 45, 68})
    assert config.node_name is None


def test_options(tmp_path: Path) -> None:
    args = parse(
        "--plugin-dir", str(tmp_path), "--ignore-xids", "13,43", "--metrics-port", "0",
        "--node-name", "n1", "--reconcile-interval", "2.5",
    )  # fmt: skip
    config = config_from(args)
    assert config.plugin_dir == tmp_path
    assert config.reconcile_interval_s == 2.5
    assert config.ignored_xids == frozenset({13, 43})
    assert config.metrics_port == 0
    assert config.node_name == "n1"
    assert callable(args.run)


def test_guard_defaults() -> None:
    config = config_from(parse())
    assert config.guard == GuardSettings(
        interval_s=0.5,
        grace_s=1.0,
        kill=True,
        process_overhead_mib=640,
        proc_root=Path("/proc"),
        container_logs=Path("/var/log/containers"),
    )


@pytest.mark.parametrize(
    ("argv", "field", "value"),
    [
        pytest.param(("--guard-interval", "0"), "interval_s", 0.0, id="off"),
        pytest.param(("--guard-interval", "0.25"), "interval_s", 0.25, id="interval"),
        pytest.param(("--guard-grace", "5"), "grace_s", 5.0, id="grace"),
        pytest.param(("--no-guard-kill",), "kill", False, id="report-only"),
        pytest.param(
            ("--guard-process-overhead-mib", "0"), "process_overhead_mib", 0, id="overhead"
        ),
        pytest.param(("--guard-proc-root", "/host/proc"), "proc_root", Path("/host/proc"),
                     id="proc-root"),
        pytest.param(("--guard-container-logs", "/l"), "container_logs", Path("/l"),
                     id="logs"),
    ],
)  # fmt: skip
def test_guard_options(argv: tuple[str, ...], field: str, value: object) -> None:
    assert getattr(config_from(parse(*argv)).guard, field) == value


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(("--ignore-xids", "13,x"), id="an XID that is no number"),
        pytest.param(("--ignore-xids", "-1"), id="a negative XID"),
        pytest.param(("--resource-domain", "example.com"), id="the resource names are fixed"),
        pytest.param(("--block-mib", "512"), id="the block size is fixed"),
        pytest.param(("--guard-interval", "-1"), id="a negative guard interval"),
        pytest.param(("--guard-interval", "soon"), id="a guard interval that is no number"),
        pytest.param(("--guard-grace", "nan"), id="a grace that is not a number of seconds"),
        pytest.param(("--guard-process-overhead-mib", "-5"), id="a negative overhead"),
    ],
)
def test_bad_options_are_refused(argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(*argv)
    assert argv[0] in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "placement"),
    [
        pytest.param((), "node", id="default-the-node-places"),
        pytest.param(("--placement", "node"), "node", id="node"),
        pytest.param(("--placement", "extender", "--node-name", "n1"), "extender",
                     id="extender"),
    ],
)  # fmt: skip
def test_placement_mode(argv: tuple[str, ...], placement: str) -> None:
    assert config_from(parse(*argv)).placement == placement


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        pytest.param(("--placement", "extender", "--node-name", "n1", "--no-cdi"),
                     "needs CDI (drop --no-cdi)", id="extender-without-cdi"),
        pytest.param(("--placement", "extender"), "needs --node-name", id="extender-without-node"),
    ],
)  # fmt: skip
def test_extender_placement_refuses_what_cannot_work_at_startup(
    argv: tuple[str, ...], reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    with pytest.raises(SystemExit) as exited:
        config_from(parse(*argv))
    assert str(exited.value).startswith("fracgpu device-plugin: --placement extender")
    assert reason in str(exited.value)


def test_an_unknown_placement_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--placement", "scheduler")
    assert "--placement" in capsys.readouterr().err
