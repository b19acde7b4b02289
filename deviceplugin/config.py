"""Configuration of the device plugin (flags of ``fracgpu device-plugin``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from core import contract
from core.units import BLOCK_MIB, DOMAIN

KUBELET_DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
KUBELET_PODRESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
# XIDs caused by the application (illegal address, MMU faults from user code, reset channel by
# the program, preemptive cleanup, video processor): the card is fine, the program is not.
DEFAULT_IGNORED_XIDS = (13, 31, 43, 45, 68)


@dataclass(frozen=True, slots=True)
class Config:
    plugin_dir: Path = KUBELET_DEVICE_PLUGIN_DIR
    podresources_socket: Path = KUBELET_PODRESOURCES_SOCKET
    host_root: Path = Path(contract.HOST_ROOT)
    dev_root: Path = Path("/dev")
    domain: str = DOMAIN
    block_mib: int = BLOCK_MIB
    ignored_xids: frozenset[int] = field(default_factory=lambda: frozenset(DEFAULT_IGNORED_XIDS))
    nvml_library: Path | None = None
    metrics_address: str = "0.0.0.0"
    metrics_port: int = 9402  # 0 disables the HTTP endpoint
    node_name: str | None = None  # publish inventory labels on this Node when set
    kubeconfig: Path | None = None  # in-cluster configuration when None
    watch_interval_s: float = 0.25  # kubelet.sock / own socket polling
    reconcile_interval_s: float = 10.0  # PodResources reconciliation
    reconcile_grace_s: float = 30.0  # allocations younger than this are never freed
    podresources_timeout_s: float = 5.0
    register_timeout_s: float = 10.0
    pair_window_s: float = 5.0
    health_wait_ms: int = 200
    health_probe_interval_s: float = 5.0
    health_quiet_s: float = 30.0  # a card recovers after this long without a critical event
    health_error_backoff_s: float = 1.0  # pause after an NVML error before rebuilding events

    @property
    def core_resource(self) -> str:
        return f"{self.domain}/core"

    @property
    def memory_resource(self) -> str:
        return f"{self.domain}/memory"

    @property
    def checkpoint_path(self) -> Path:
        return self.host_root / "checkpoint.json"

    @property
    def containers_dir(self) -> Path:
        return self.host_root / "containers"

    @property
    def hook_library(self) -> Path:
        return hook_library(self.host_root)

    @property
    def ld_so_preload(self) -> Path:
        return ld_so_preload(self.host_root)


def hook_library(host_root: Path) -> Path:
    """Where the node keeps the hook that containers get mounted (both modes)."""
    return host_root / "lib" / "libfracgpu.so"


def ld_so_preload(host_root: Path) -> Path:
    """The preload file naming the hook's path inside containers (both modes)."""
    return host_root / "ld.so.preload"
