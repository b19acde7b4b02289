"""Configuration of the DRA kubelet plugin (flags of ``fracgpu dra-plugin``) and where it keeps
things on the node.

Layout, with the defaults (kubelet's root ``/var/lib/kubelet``)::

    /var/lib/kubelet/plugins_registry/<driver>-reg.sock   registration; kubelet watches this dir
    /var/lib/kubelet/plugins/<driver>/dra.sock            v1.DRAPlugin and the health stream
    /var/lib/kubelet/plugins/<driver>/checkpoint.json     prepared claims
    /var/run/cdi/<vendor>-<class>_<claim uid>.json         one CDI spec per prepared claim
    /var/lib/fracgpu/claims/<claim uid>/limits/limits     the claim's limits; mounted read-only
    /var/lib/fracgpu/claims/<claim uid>/shared/           the hook's accounting; read-write

kubelet reads the service socket's path from GetInfo and dials it on the host, so the DaemonSet
mounts these directories at the same paths as on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from core import contract, dra
from deviceplugin.shared.flags import (
    DEFAULT_IGNORED_XIDS,
    KUBELET_PODRESOURCES_SOCKET,
    DaemonSetRef,
    GuardSettings,
)
from deviceplugin.shared.hostfiles import hook_library, ld_so_preload

DEFAULT_DRIVER = dra.DRIVER
DEFAULT_KUBELET_ROOT = Path("/var/lib/kubelet")
DEFAULT_CDI_ROOT = Path("/var/run/cdi")
DEFAULT_METRICS_PORT = 9403  # the device plugin has 9402; a node runs one of the two


@dataclass(frozen=True, slots=True)
class DraConfig:
    node_name: str
    driver_name: str = DEFAULT_DRIVER
    kubeconfig: Path | None = None  # in-cluster configuration when None
    kubelet_root: Path = DEFAULT_KUBELET_ROOT
    cdi_root: Path = DEFAULT_CDI_ROOT
    host_root: Path = Path(contract.HOST_ROOT)
    dev_root: Path = Path("/dev")
    nvml_library: Path | None = None
    metrics_address: str = "0.0.0.0"
    metrics_port: int = DEFAULT_METRICS_PORT  # 0 disables the HTTP endpoint
    ignored_xids: frozenset[int] = field(default_factory=lambda: frozenset(DEFAULT_IGNORED_XIDS))
    health_quiet_s: float = 30.0
    health_wait_ms: int = 200
    health_probe_interval_s: float = 5.0
    # kubelet marks a device Unknown after this long without a health update (its default).
    health_timeout_s: int = 30
    # The health stream repeats the full list this often, well inside the timeout.
    health_resend_s: float = 10.0
    socket_check_s: float = 0.25  # how often the sockets are checked for deletion
    claim_timeout_s: float = 10.0  # one ResourceClaim GET (kubelet waits 45 s per call)
    reconcile_interval_s: float = 60.0  # prepared claims against the API server
    guard: GuardSettings = field(default_factory=GuardSettings)  # the node guard (shared/guard.py)
    # kubelet's PodResources API, the guard's view of claims; None: under kubelet_root
    podresources_socket: Path | None = None
    podresources_timeout_s: float = 5.0
    # Its DaemonSet: stopped while that is gone or being deleted, the plugin removes its host
    # files (shared/uninstall.py); None: never. uninstall_timeout_s bounds the question at stop.
    daemonset: DaemonSetRef | None = None
    uninstall_timeout_s: float = 5.0

    @property
    def registry_socket(self) -> Path:
        return self.kubelet_root / "plugins_registry" / f"{self.driver_name}-reg.sock"

    @property
    def plugin_dir(self) -> Path:
        return self.kubelet_root / "plugins" / self.driver_name

    @property
    def service_socket(self) -> Path:
        return self.plugin_dir / "dra.sock"

    @property
    def pod_resources_socket(self) -> Path:
        """Where kubelet serves PodResources: ``<root-dir>/pod-resources/kubelet.sock``."""
        if self.podresources_socket is not None:
            return self.podresources_socket
        return self.kubelet_root / KUBELET_PODRESOURCES_SOCKET.relative_to("/var/lib/kubelet")

    @property
    def checkpoint_path(self) -> Path:
        return self.plugin_dir / "checkpoint.json"

    @property
    def claims_dir(self) -> Path:
        return self.host_root / "claims"

    @property
    def hook_library(self) -> Path:
        return hook_library(self.host_root)

    @property
    def ld_so_preload(self) -> Path:
        return ld_so_preload(self.host_root)

    @property
    def pool_name(self) -> str:
        return self.node_name
