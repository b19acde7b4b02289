"""``fracgpu device-plugin``: run the kubelet device plugin on a GPU node.

The flags both agents take come from ``shared.flags``; only this agent's own are here.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from deviceplugin.classic.config import (
    DEFAULT_RECONCILE_INTERVAL_S,
    DEVICE_PLUGINS,
    PLACEMENTS,
    Config,
)
from deviceplugin.shared.flags import add_node_flags, node_settings
from deviceplugin.shared.settings import SettingsError, node_fields

DAEMONSET = "fracgpu-device-plugin"  # its DaemonSet in deploy/ and the Helm chart
METRICS_PORT = 9402


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "device-plugin",
        help="run the kubelet device plugin (fracgpu.io/core and fracgpu.io/memory)",
        description="Advertise this node's GPUs to kubelet as fracgpu.io/core (100 per card) "
        "and fracgpu.io/memory (one per block of card memory), allocate them, write each "
        "container's limits and watch card health.",
    )
    add_node_flags(parser, daemonset=DAEMONSET, metrics_port=METRICS_PORT)
    own = parser.add_argument_group("device plugin")
    own.add_argument(
        "--plugin-dir",
        type=Path,
        default=None,
        help="kubelet's device plugin directory (default: <kubelet-root>/device-plugins)",
    )
    own.add_argument(
        "--no-cdi",
        action="store_true",
        help="for runtimes without CDI: name the card in the Allocate answer instead; a pod "
        "admitted while no single card can host it then fails instead of waiting",
    )
    own.add_argument(
        "--no-node-allocatable",
        dest="node_allocatable",
        action="store_false",
        help="leave the Node's allocatable fracgpu resources to kubelet, which updates them "
        "every node-status period (10 s): on nodes with several cards the scheduler may then "
        "place a share no card can hold for that long (needs no nodes/status permission)",
    )
    own.add_argument(
        "--reconcile-interval",
        type=float,
        default=DEFAULT_RECONCILE_INTERVAL_S,
        metavar="SECONDS",
        help="how often kubelet's PodResources is read to free the devices of ended pods",
    )
    own.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="node",
        help="who chooses each container's card: 'node' (default), this plugin once kubelet "
        "admits the container, which lists only capacity one card can host; 'extender', "
        "fracgpu's scheduler extender, which records the card on the pod as it binds it, and "
        "this plugin then lists every ID of every healthy card and places each container on "
        "its recorded card at PreStartContainer (needs CDI and --node-name)",
    )
    parser.set_defaults(run=run)


def config_from(args: argparse.Namespace) -> Config:
    node = node_settings(args, daemonset=DAEMONSET, command="device-plugin")
    try:
        return Config(
            **node_fields(node),
            plugin_dir=args.plugin_dir or node.kubelet_root / DEVICE_PLUGINS,
            cdi_root=None if args.no_cdi else args.cdi_root,
            node_allocatable=args.node_allocatable,
            reconcile_interval_s=args.reconcile_interval,
            placement=args.placement,
        )
    except SettingsError as exc:
        raise SystemExit(f"fracgpu device-plugin: {exc}") from None


def run(args: argparse.Namespace) -> int:
    from deviceplugin.classic.daemon import run as run_daemon

    return run_daemon(config_from(args))
