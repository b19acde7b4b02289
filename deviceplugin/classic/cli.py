"""``fracgpu device-plugin``: run the kubelet device plugin on a GPU node."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from core import contract
from core.flags import add_kube_flags
from deviceplugin.classic.config import (
    DEFAULT_RECONCILE_INTERVAL_S,
    KUBELET_DEVICE_PLUGIN_DIR,
    Config,
)
from deviceplugin.shared.flags import (
    DEFAULT_IGNORED_XIDS,
    KUBELET_PODRESOURCES_SOCKET,
    add_daemonset_flag,
    add_guard_flags,
    guard_settings,
    resolve_daemonset,
)

DAEMONSET = "fracgpu-device-plugin"  # its DaemonSet in deploy/ and the Helm chart


def _xids(text: str) -> frozenset[int]:
    try:
        values = frozenset(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--ignore-xids {text!r}: expected comma-separated XID numbers, e.g. 13,31,43"
        ) from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"--ignore-xids {text!r}: XIDs are positive numbers")
    return values


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "device-plugin",
        help="run the kubelet device plugin (fracgpu.io/core and fracgpu.io/memory)",
        description="Advertise this node's GPUs to kubelet as fracgpu.io/core (100 per card) "
        "and fracgpu.io/memory (one per block of card memory), allocate them, write each "
        "container's limits and watch card health.",
    )
    parser.add_argument("--plugin-dir", type=Path, default=KUBELET_DEVICE_PLUGIN_DIR)
    parser.add_argument("--pod-resources-socket", type=Path, default=KUBELET_PODRESOURCES_SOCKET)
    parser.add_argument(
        "--host-root",
        type=Path,
        default=Path(contract.HOST_ROOT),
        help="node directory for the hook, limits, accounting and checkpoint",
    )
    parser.add_argument("--dev-root", type=Path, default=Path("/dev"))
    parser.add_argument(
        "--cdi-root",
        type=Path,
        default=Path("/var/run/cdi"),
        help="where the container runtime reads CDI specs; each container's card reaches it "
        "through one, written at PreStartContainer (default: /var/run/cdi)",
    )
    parser.add_argument(
        "--no-cdi",
        action="store_true",
        help="for runtimes without CDI: name the card in the Allocate answer instead; a pod "
        "admitted while no single card can host it then fails instead of waiting",
    )
    parser.add_argument(
        "--ignore-xids",
        type=_xids,
        default=frozenset(DEFAULT_IGNORED_XIDS),
        help="XIDs caused by applications, which do not mark a card unhealthy "
        f"(default {','.join(map(str, DEFAULT_IGNORED_XIDS))})",
    )
    parser.add_argument("--nvml-library", type=Path, default=None)
    parser.add_argument("--metrics-address", default="0.0.0.0")
    parser.add_argument(
        "--metrics-port", type=int, default=9402, help="/metrics and /healthz; 0 disables"
    )
    parser.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME"),
        help="publish the inventory on this Node (default: $NODE_NAME; unset: do not publish)",
    )
    parser.add_argument(
        "--no-node-allocatable",
        dest="node_allocatable",
        action="store_false",
        help="leave the Node's allocatable fracgpu resources to kubelet, which updates them "
        "every node-status period (10 s): on nodes with several cards the scheduler may then "
        "place a share no card can hold for that long (needs no nodes/status permission)",
    )
    add_kube_flags(parser, context=False)
    parser.add_argument(
        "--reconcile-interval",
        type=float,
        default=DEFAULT_RECONCILE_INTERVAL_S,
        metavar="SECONDS",
        help="how often kubelet's PodResources is read to free the devices of ended pods",
    )
    parser.add_argument(
        "--health-quiet",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="a card is Healthy again after this long without a critical event",
    )
    add_daemonset_flag(parser, DAEMONSET)
    add_guard_flags(parser)
    parser.set_defaults(run=run)


def config_from(args: argparse.Namespace) -> Config:
    return Config(
        plugin_dir=args.plugin_dir,
        podresources_socket=args.pod_resources_socket,
        host_root=args.host_root,
        dev_root=args.dev_root,
        cdi_root=None if args.no_cdi else args.cdi_root,
        ignored_xids=args.ignore_xids,
        nvml_library=args.nvml_library,
        metrics_address=args.metrics_address,
        metrics_port=args.metrics_port,
        node_name=args.node_name,
        node_allocatable=args.node_allocatable,
        kubeconfig=args.kubeconfig,
        reconcile_interval_s=args.reconcile_interval,
        health_quiet_s=args.health_quiet,
        guard=guard_settings(args),
        daemonset=resolve_daemonset(args.daemonset, DAEMONSET),
    )


def run(args: argparse.Namespace) -> int:
    from deviceplugin.classic.daemon import run as run_daemon

    return run_daemon(config_from(args))
