"""Settings and flags both node agents take: the guard's, the XIDs that leave a card healthy,
where kubelet's PodResources API listens, and the DaemonSet whose deletion means uninstall.
Light on purpose: building the command line imports no NVML, gRPC or Prometheus."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

KUBELET_PODRESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")

# The node agents' DaemonSets as deploy/ and the Helm chart name them, one per mode. An agent
# that is being uninstalled leaves the hook files on the node while the other one's exists (a
# `helm upgrade` that switches modes: both agents mount the same hook).
NODE_AGENT_DAEMONSETS = ("fracgpu-device-plugin", "fracgpu-dra-plugin")
# Where kubelet puts the pod's namespace beside its service account token.
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")

# XIDs caused by the application (illegal address, MMU faults from user code, reset channel by
# the program, preemptive cleanup, video processor): the card is fine, the program is not.
DEFAULT_IGNORED_XIDS = (13, 31, 43, 45, 68)

# What the guard allows each process beyond its container's grant: its CUDA context, which NVML
# counts and the hook does not. A bare context took 518 MiB on an H200 (driver 580.159).
DEFAULT_PROCESS_OVERHEAD_MIB = 640


@dataclass(frozen=True, slots=True)
class GuardSettings:
    """The guard's flags, the same in both agents (``--guard-*``)."""

    interval_s: float = 0.5  # 0 turns the guard off
    grace_s: float = 1.0  # continuous excess before the kill
    kill: bool = True
    process_overhead_mib: int = DEFAULT_PROCESS_OVERHEAD_MIB
    proc_root: Path = Path("/proc")  # the node's, with the host PID namespace
    container_logs: Path = Path("/var/log/containers")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more seconds")
    return value


def _mib(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of MiB") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more MiB")
    return value


def add_guard_flags(parser: argparse.ArgumentParser) -> None:
    """``--guard-*``: the node guard's flags, the same in both agents."""
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


@dataclass(frozen=True, slots=True)
class DaemonSetRef:
    """The agent's own DaemonSet (``--daemonset NAMESPACE/NAME``)."""

    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


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


def add_daemonset_flag(parser: argparse.ArgumentParser, name: str) -> None:
    """``--daemonset``: whose deletion tells the stopping agent that it is being uninstalled."""
    parser.add_argument(
        "--daemonset",
        type=daemonset_ref,
        default=FROM_POD,
        metavar="NAMESPACE/NAME",
        help="this agent's DaemonSet: stopped while it is gone or being deleted (an uninstall), "
        "the agent removes what it wrote on the node; '' never (default: the pod's namespace "
        f"and {name}, none outside a pod)",
    )


def resolve_daemonset(flag: object, name: str) -> DaemonSetRef | None:
    """What ``--daemonset`` says, its default resolved now (inside the pod)."""
    if flag is FROM_POD:
        namespace = pod_namespace()
        return DaemonSetRef(namespace, name) if namespace else None
    assert flag is None or isinstance(flag, DaemonSetRef)
    return flag


def guard_settings(args: argparse.Namespace) -> GuardSettings:
    return GuardSettings(
        interval_s=args.guard_interval,
        grace_s=args.guard_grace,
        kill=args.guard_kill,
        process_overhead_mib=args.guard_process_overhead_mib,
        proc_root=args.guard_proc_root,
        container_logs=args.guard_container_logs,
    )


__all__ = [
    "DEFAULT_IGNORED_XIDS",
    "DEFAULT_PROCESS_OVERHEAD_MIB",
    "KUBELET_PODRESOURCES_SOCKET",
    "NODE_AGENT_DAEMONSETS",
    "SERVICE_ACCOUNT_NAMESPACE",
    "DaemonSetRef",
    "GuardSettings",
    "add_daemonset_flag",
    "add_guard_flags",
    "daemonset_ref",
    "guard_settings",
    "pod_namespace",
    "resolve_daemonset",
]
