"""The settings both node agents share, as one model validated once: where kubelet and the
runtime keep things on the node, how NVML and the health thread behave, the node guard, /metrics,
and the DaemonSet whose deletion means uninstall.

Each agent's configuration extends :class:`NodeSettings` with what only it has (the device
plugin's pairing and reconciliation; the DRA plugin's driver name and claim timeouts), so a field
both need is declared here once and means the same in both modes. The command line for these
fields is :func:`deviceplugin.shared.flags.add_node_flags`.

Light on purpose: importing it loads no NVML, gRPC or Prometheus.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from core import contract
from deviceplugin.shared.hostfiles import hook_library, ld_so_preload

DEFAULT_KUBELET_ROOT = Path("/var/lib/kubelet")
# Under kubelet's --root-dir, as kubelet serves it.
PODRESOURCES_SOCKET = Path("pod-resources/kubelet.sock")
KUBELET_PODRESOURCES_SOCKET = DEFAULT_KUBELET_ROOT / PODRESOURCES_SOCKET
DEFAULT_CDI_ROOT = Path("/var/run/cdi")

# The node agents' DaemonSets as deploy/ and the Helm chart name them, one per mode. An agent
# that is being uninstalled leaves the hook files on the node while the other one's exists (a
# `helm upgrade` that switches modes: both agents mount the same hook).
NODE_AGENT_DAEMONSETS = ("fracgpu-device-plugin", "fracgpu-dra-plugin")

# XIDs caused by the application (illegal address, MMU faults from user code, reset channel by
# the program, preemptive cleanup, video processor): the card is fine, the program is not.
DEFAULT_IGNORED_XIDS = (13, 31, 43, 45, 68)

# What the guard allows each process beyond its container's grant: its CUDA context, which NVML
# counts and the hook does not. A bare context took 518 MiB on an H200 (driver 580.159).
DEFAULT_PROCESS_OVERHEAD_MIB = 640


class SettingsError(ValueError):
    """A node setting out of its range; the message names the setting, the value and the rule."""


@dataclass(frozen=True, slots=True)
class GuardSettings:
    """The node guard's settings (``--guard-*``)."""

    interval_s: float = 0.5  # 0 turns the guard off
    grace_s: float = 1.0  # continuous excess before the kill
    kill: bool = True
    process_overhead_mib: int = DEFAULT_PROCESS_OVERHEAD_MIB
    proc_root: Path = Path("/proc")  # the node's, with the host PID namespace
    container_logs: Path = Path("/var/log/containers")

    def __post_init__(self) -> None:
        _at_least("guard interval_s", self.interval_s, 0)
        _at_least("guard grace_s", self.grace_s, 0)
        _at_least("guard process_overhead_mib", self.process_overhead_mib, 0)


@dataclass(frozen=True, slots=True)
class DaemonSetRef:
    """The agent's own DaemonSet (``--daemonset NAMESPACE/NAME``)."""

    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class NodeSettings:
    """What either node agent needs of the node it runs on, and how its node services behave."""

    # This Node: the device plugin publishes labels and allocatable on it when set; the DRA
    # plugin requires it (its slice's pool and the guard's Events name it).
    node_name: str | None = None
    kubeconfig: Path | None = None  # None: in-cluster, then $KUBECONFIG, then ~/.kube/config
    kubelet_root: Path = DEFAULT_KUBELET_ROOT  # kubelet's --root-dir
    # kubelet's PodResources API (who holds what); None: <kubelet_root>/pod-resources/kubelet.sock
    podresources_socket: Path | None = None
    podresources_timeout_s: float = 5.0
    host_root: Path = Path(contract.HOST_ROOT)  # the hook, limits, accounting, checkpoint
    dev_root: Path = Path("/dev")
    nvml_library: Path | None = None  # None: pynvml's default (libnvidia-ml.so.1)
    metrics_address: str = "0.0.0.0"
    metrics_port: int = 9402  # 0 disables /metrics and /healthz
    ignored_xids: frozenset[int] = field(default_factory=lambda: frozenset(DEFAULT_IGNORED_XIDS))
    health_wait_ms: int = 200  # one NVML event wait
    health_probe_interval_s: float = 5.0
    health_quiet_s: float = 30.0  # a card recovers after this long without a critical event
    health_error_backoff_s: float = 1.0  # pause after an NVML error before rebuilding events
    guard: GuardSettings = field(default_factory=GuardSettings)
    # Its DaemonSet: stopped while that is gone or being deleted, the agent removes its host
    # files (shared/uninstall.py); None: never. uninstall_timeout_s bounds the question at stop.
    daemonset: DaemonSetRef | None = None
    uninstall_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0 <= self.metrics_port <= 65535:
            raise SettingsError(
                f"metrics port {self.metrics_port}: must be 0 (off) to 65535; pass --metrics-port"
            )
        if any(xid <= 0 for xid in self.ignored_xids):
            raise SettingsError(
                f"ignored XIDs {sorted(self.ignored_xids)}: XIDs are positive numbers"
            )
        _at_least("health_wait_ms", self.health_wait_ms, 1)
        for name in (
            "podresources_timeout_s",
            "health_probe_interval_s",
            "health_error_backoff_s",
            "uninstall_timeout_s",
        ):
            _above(name, getattr(self, name), 0)
        _at_least("health_quiet_s", self.health_quiet_s, 0)

    @property
    def podresources_path(self) -> Path:
        """Where kubelet serves PodResources: the flag, else under kubelet's root."""
        if self.podresources_socket is not None:
            return self.podresources_socket
        return self.kubelet_root / PODRESOURCES_SOCKET

    @property
    def hook_library(self) -> Path:
        return hook_library(self.host_root)

    @property
    def ld_so_preload(self) -> Path:
        return ld_so_preload(self.host_root)


def node_fields(settings: NodeSettings) -> dict[str, Any]:
    """The common fields of ``settings``, as keywords for an agent's configuration."""
    return {f.name: getattr(settings, f.name) for f in fields(NodeSettings)}


def _at_least(name: str, value: float, least: float) -> None:
    if not value >= least:  # NaN fails too
        raise SettingsError(f"{name} {value!r}: must be {least} or more")


def _above(name: str, value: float, bound: float) -> None:
    if not value > bound:
        raise SettingsError(f"{name} {value!r}: must be more than {bound}")


__all__ = [
    "DEFAULT_CDI_ROOT",
    "DEFAULT_IGNORED_XIDS",
    "DEFAULT_KUBELET_ROOT",
    "DEFAULT_PROCESS_OVERHEAD_MIB",
    "KUBELET_PODRESOURCES_SOCKET",
    "NODE_AGENT_DAEMONSETS",
    "PODRESOURCES_SOCKET",
    "DaemonSetRef",
    "GuardSettings",
    "NodeSettings",
    "SettingsError",
    "node_fields",
]
