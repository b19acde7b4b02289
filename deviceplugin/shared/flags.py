"""The command-line flags both node agents take, defined once: :func:`add_node_flags` adds them
to either agent's parser and :func:`node_settings` reads them back as one validated
:class:`~deviceplugin.shared.settings.NodeSettings`.

An agent's own parser adds only what no other agent has, so a common flag cannot drift (a test
compares the two parsers). Building the command line imports no NVML, gRPC or Prometheus.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from core import contract
from core.flags import add_kube_flags
from deviceplugin.shared.settings import (
    DEFAULT_CDI_ROOT,
    DEFAULT_IGNORED_XIDS,
    DEFAULT_KUBELET_ROOT,
    DEFAULT_PROCESS_OVERHEAD_MIB,
    DaemonSetRef,
    GuardSettings,
    NodeSettings,
    SettingsError,
)

N = TypeVar("N", int, float)

# Where kubelet puts the pod's namespace beside its service account token.
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def _number(
    parse: Callable[[str], N], what: str, least: N, most: N | None = None, rule: str = ""
) -> Callable[[str], N]:
    """An argparse type: ``parse`` the text as ``what``, within ``least`` to ``most``."""

    def convert(text: str) -> N:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not (least <= value and (most is None or value <= most)):  # NaN fails too
            raise argparse.ArgumentTypeError(f"{text!r} must be {rule}")
        return value

    return convert


_seconds = _number(float, "a number of seconds", 0.0, rule="0 or more seconds")
_mib = _number(int, "a whole number of MiB", 0, rule="0 or more MiB")
_port = _number(int, "a port number", 0, 65535, rule="0 (off) to 65535")


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


def daemonset_ref(text: str) -> DaemonSetRef | None:
    """``NAMESPACE/NAME``; empty: none (the agent then never removes its host files)."""
    if not text:
        return None
    namespace, _, name = text.partition("/")
    if not namespace or not name or "/" in name:
        raise argparse.ArgumentTypeError(f"--daemonset {text!r}: expected NAMESPACE/NAME")
    return DaemonSetRef(namespace, name)


def pod_namespace() -> str:
    """The namespace the agent's pod runs in ("" outside a pod): ``$POD_NAMESPACE``, else the
    one kubelet writes beside the pod's service account token."""
    if namespace := os.environ.get("POD_NAMESPACE", "").strip():
        return namespace
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    except OSError:
        return ""


# --daemonset not given: the pod's namespace and the agent's DaemonSet name, found when the
# agent starts (building the command line reads no file).
FROM_POD = object()


def resolve_daemonset(flag: object, name: str) -> DaemonSetRef | None:
    """What ``--daemonset`` says, its default resolved now (inside the pod)."""
    if flag is FROM_POD:
        namespace = pod_namespace()
        return DaemonSetRef(namespace, name) if namespace else None
    assert flag is None or isinstance(flag, DaemonSetRef)
    return flag


def add_node_flags(parser: argparse.ArgumentParser, *, daemonset: str, metrics_port: int) -> None:
    """The flags every node agent takes. ``daemonset`` names the agent's DaemonSet (the default
    of ``--daemonset``); ``metrics_port`` differs per agent so that both may run on one node
    while a cluster switches modes."""
    node = parser.add_argument_group("node", "this node, kubelet, the runtime, the agent's files")
    node.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME"),
        help="this node (default: $NODE_NAME, which the DaemonSet sets from spec.nodeName)",
    )
    add_kube_flags(node, context=False)
    node.add_argument(
        "--kubelet-root",
        type=Path,
        default=DEFAULT_KUBELET_ROOT,
        help="kubelet's --root-dir: its sockets and PodResources API are under it "
        "(default %(default)s)",
    )
    node.add_argument(
        "--pod-resources-socket",
        type=Path,
        default=None,
        help="kubelet's PodResources API, which says which container holds what "
        "(default: <kubelet-root>/pod-resources/kubelet.sock)",
    )
    node.add_argument(
        "--host-root",
        type=Path,
        default=Path(contract.HOST_ROOT),
        help="node directory for the hook, the limits, the accounting and the checkpoint "
        "(default %(default)s)",
    )
    node.add_argument(
        "--dev-root",
        type=Path,
        default=Path("/dev"),
        help="where the card device nodes are (default %(default)s)",
    )
    node.add_argument(
        "--cdi-root",
        type=Path,
        default=DEFAULT_CDI_ROOT,
        help="where the container runtime reads CDI specs; each container's card reaches it "
        "through one (default %(default)s)",
    )
    node.add_argument(
        "--daemonset",
        type=daemonset_ref,
        default=FROM_POD,
        metavar="NAMESPACE/NAME",
        help="this agent's DaemonSet: stopped while it is gone or being deleted (an uninstall), "
        "the agent removes what it wrote on the node; '' never (default: the pod's namespace "
        f"and {daemonset}, none outside a pod)",
    )
    _add_health_flags(parser, metrics_port)
    _add_guard_flags(parser)


def _add_health_flags(parser: argparse.ArgumentParser, metrics_port: int) -> None:
    health = parser.add_argument_group("health", "NVML, card health, /metrics and /healthz")
    health.add_argument(
        "--nvml-library",
        type=Path,
        default=None,
        help="an NVML library to load by path (default: libnvidia-ml.so.1)",
    )
    health.add_argument(
        "--ignore-xids",
        type=_xids,
        default=frozenset(DEFAULT_IGNORED_XIDS),
        help="XIDs caused by applications, which do not mark a card unhealthy "
        f"(default {','.join(map(str, DEFAULT_IGNORED_XIDS))})",
    )
    health.add_argument(
        "--health-quiet",
        type=_seconds,
        default=30.0,
        metavar="SECONDS",
        help="a card is Healthy again after this long without a critical event (default 30)",
    )
    health.add_argument(
        "--metrics-address",
        default="0.0.0.0",
        help="the interface of /metrics and /healthz (default %(default)s)",
    )
    health.add_argument(
        "--metrics-port",
        type=_port,
        default=metrics_port,
        help="/metrics and /healthz; 0 disables (default %(default)s)",
    )


def _add_guard_flags(parser: argparse.ArgumentParser) -> None:
    """``--guard-*``: the node guard's flags."""
    guard = parser.add_argument_group(
        "node guard", "compare each container's memory in NVML with its grant and act on excess"
    )
    guard.add_argument(
        "--guard-interval",
        type=_seconds,
        default=0.5,
        metavar="SECONDS",
        help="how often NVML's per-process memory is read (0 turns the guard off)",
    )
    guard.add_argument(
        "--guard-grace",
        type=_seconds,
        default=1.0,
        metavar="SECONDS",
        help="how long an excess lasts before the container's largest processes are killed",
    )
    guard.add_argument(
        "--guard-kill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="kill after the grace (--no-guard-kill: report only)",
    )
    guard.add_argument(
        "--guard-process-overhead-mib",
        type=_mib,
        default=DEFAULT_PROCESS_OVERHEAD_MIB,
        metavar="MIB",
        help="allowance per process for its CUDA context, which NVML counts and the hook does not",
    )
    guard.add_argument(
        "--guard-proc-root",
        type=Path,
        default=Path("/proc"),
        help="the node's /proc (the DaemonSet runs with hostPID)",
    )
    guard.add_argument(
        "--guard-container-logs",
        type=Path,
        default=Path("/var/log/containers"),
        help="kubelet's container log links, which name each container ID's pod and container",
    )


def node_settings(args: argparse.Namespace, *, daemonset: str, command: str) -> NodeSettings:
    """The common flags as one validated model; a value out of range exits naming the flag."""
    try:
        return NodeSettings(
            node_name=args.node_name or None,
            kubeconfig=args.kubeconfig,
            kubelet_root=args.kubelet_root,
            podresources_socket=args.pod_resources_socket,
            host_root=args.host_root,
            dev_root=args.dev_root,
            nvml_library=args.nvml_library,
            metrics_address=args.metrics_address,
            metrics_port=args.metrics_port,
            ignored_xids=args.ignore_xids,
            health_quiet_s=args.health_quiet,
            guard=GuardSettings(
                interval_s=args.guard_interval,
                grace_s=args.guard_grace,
                kill=args.guard_kill,
                process_overhead_mib=args.guard_process_overhead_mib,
                proc_root=args.guard_proc_root,
                container_logs=args.guard_container_logs,
            ),
            daemonset=resolve_daemonset(args.daemonset, daemonset),
        )
    except SettingsError as exc:
        raise SystemExit(f"fracgpu {command}: {exc}") from None


__all__ = [
    "FROM_POD",
    "SERVICE_ACCOUNT_NAMESPACE",
    "add_node_flags",
    "daemonset_ref",
    "node_settings",
    "pod_namespace",
    "resolve_daemonset",
]
