"""``fracgpu dra-plugin``: run the DRA kubelet plugin on a GPU node (DRA mode).

Only flags here, and of them only this agent's own (the common ones come from ``shared.flags``);
the plugin itself (gRPC, NVML, the Kubernetes client) is imported when the command runs.
"""

from __future__ import annotations

import argparse

from core.flags import deferred
from deviceplugin.dra.config import DEFAULT_DRIVER, DEFAULT_METRICS_PORT, DraConfig
from deviceplugin.shared.flags import add_node_flags, node_settings
from deviceplugin.shared.settings import SettingsError, node_fields

DAEMONSET = "fracgpu-dra-plugin"  # its DaemonSet in deploy/overlays/dra and the Helm chart


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "dra-plugin",
        help="run the DRA kubelet plugin (DRA mode, Kubernetes >= 1.36)",
        description="Publish this node's GPUs as one ResourceSlice (each card a device whose "
        "cores and memory many claims consume), prepare the claims kubelet names by writing "
        "their limits and CDI specs, and watch card health.",
    )
    add_node_flags(parser, daemonset=DAEMONSET, metrics_port=DEFAULT_METRICS_PORT)
    own = parser.add_argument_group("DRA plugin")
    own.add_argument(
        "--driver-name",
        default=DEFAULT_DRIVER,
        help=f"DRA driver name; the DeviceClass selects it (default {DEFAULT_DRIVER})",
    )
    parser.set_defaults(run=deferred("deviceplugin.dra.cli", "run"))


def config_from(args: argparse.Namespace) -> DraConfig:
    node = node_settings(args, daemonset=DAEMONSET, command="dra-plugin")
    try:
        return DraConfig(**node_fields(node), driver_name=args.driver_name, cdi_root=args.cdi_root)
    except SettingsError as exc:
        raise SystemExit(f"fracgpu dra-plugin: {exc}") from None


def run(args: argparse.Namespace) -> int:
    from deviceplugin.dra.daemon import run as run_daemon

    return run_daemon(config_from(args))
