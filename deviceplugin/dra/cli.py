"""``fracgpu dra-plugin``: run the DRA kubelet plugin on a GPU node (DRA mode).

Only flags here; the plugin itself (gRPC, NVML, the Kubernetes client) is imported when the
command runs.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from core import contract
from core.flags import add_kube_flags, deferred
from deviceplugin.dra.config import (
    DEFAULT_CDI_ROOT,
    DEFAULT_DRIVER,
    DEFAULT_KUBELET_ROOT,
    DEFAULT_METRICS_PORT,
    DraConfig,
)
from deviceplugin.shared.flags import (
    add_daemonset_flag,
    add_guard_flags,
    guard_settings,
    resolve_daemonset,
)

DAEMONSET = "fracgpu-dra-plugin"  # its DaemonSet in deploy/overlays/dra and the Helm chart


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "dra-plugin",
        help="run the DRA kubelet plugin (DRA mode, Kubernetes >= 1.36)",
        description="Publish this node's GPUs as one ResourceSlice (each card a device whose "
        "cores and memory many claims consume), prepare the claims kubelet names by writing "
        "their limits and CDI specs, and watch card health.",
    )
    parser.add_argument(
        "--driver-name",
        default=DEFAULT_DRIVER,
        help=f"DRA driver name; the DeviceClass selects it (default {DEFAULT_DRIVER})",
    )
    parser.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME"),
        help="this node's name (default: $NODE_NAME, which the DaemonSet sets)",
    )
    add_kube_flags(parser, context=False)
    parser.add_argument(
        "--kubelet-root",
        type=Path,
        default=DEFAULT_KUBELET_ROOT,
        help="kubelet's --root-dir: the registration socket goes under plugins_registry/, the "
        "service socket and checkpoint under plugins/<driver>/ (default %(default)s)",
    )
    parser.add_argument(
        "--cdi-root",
        type=Path,
        default=DEFAULT_CDI_ROOT,
        help="where the container runtime reads CDI specs (default %(default)s)",
    )
    parser.add_argument(
        "--host-root",
        type=Path,
        default=Path(contract.HOST_ROOT),
        help="node directory for the hook, the claims' limits and accounting (default %(default)s)",
    )
    parser.add_argument("--dev-root", type=Path, default=Path("/dev"))
    parser.add_argument("--nvml-library", type=Path, default=None)
    parser.add_argument("--metrics-address", default="0.0.0.0")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help="/metrics and /healthz; 0 disables (default %(default)s)",
    )
    parser.add_argument(
        "--pod-resources-socket",
        type=Path,
        default=None,
        help="kubelet's PodResources API, where the node guard learns which claims each "
        "container uses (default: <kubelet-root>/pod-resources/kubelet.sock)",
    )
    add_daemonset_flag(parser, DAEMONSET)
    add_guard_flags(parser)
    parser.set_defaults(run=deferred("deviceplugin.dra.cli", "run"))


def config_from(args: argparse.Namespace) -> DraConfig:
    if not args.node_name:
        raise SystemExit(
            "fracgpu dra-plugin: no node name: pass --node-name or set NODE_NAME (the DaemonSet "
            "sets it from spec.nodeName)"
        )
    return DraConfig(
        node_name=args.node_name,
        driver_name=args.driver_name,
        kubeconfig=args.kubeconfig,
        kubelet_root=args.kubelet_root,
        cdi_root=args.cdi_root,
        host_root=args.host_root,
        dev_root=args.dev_root,
        nvml_library=args.nvml_library,
        metrics_address=args.metrics_address,
        metrics_port=args.metrics_port,
        guard=guard_settings(args),
        podresources_socket=args.pod_resources_socket,
        daemonset=resolve_daemonset(args.daemonset, DAEMONSET),
    )


def run(args: argparse.Namespace) -> int:
    from deviceplugin.dra.daemon import run as run_daemon

    return run_daemon(config_from(args))
