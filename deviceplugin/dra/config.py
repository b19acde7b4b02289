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

from dataclasses import dataclass
from pathlib import Path

from core import dra
from deviceplugin.shared.settings import DEFAULT_CDI_ROOT, NodeSettings, SettingsError

DEFAULT_DRIVER = dra.DRIVER
DEFAULT_METRICS_PORT = 9403  # the device plugin has 9402; a node runs one of the two


@dataclass(frozen=True, slots=True)
class DraConfig(NodeSettings):
    """The DRA plugin's settings: the common node settings and what only this agent has."""

    metrics_port: int = DEFAULT_METRICS_PORT
    driver_name: str = DEFAULT_DRIVER
    cdi_root: Path = DEFAULT_CDI_ROOT
    # kubelet marks a device Unknown after this long without a health update (its default).
    health_timeout_s: int = 30
    # The health stream repeats the full list this often, well inside the timeout.
    health_resend_s: float = 10.0
    socket_check_s: float = 0.25  # how often the sockets are checked for deletion
    claim_timeout_s: float = 10.0  # one ResourceClaim GET (kubelet waits 45 s per call)
    reconcile_interval_s: float = 60.0  # prepared claims against the API server

    def __post_init__(self) -> None:
        NodeSettings.__post_init__(self)
        if not self.node_name:
            raise SettingsError(
                "no node name: pass --node-name or set NODE_NAME (the DaemonSet sets it from "
                "spec.nodeName); the DRA plugin publishes its ResourceSlice for that node"
            )

    @property
    def node(self) -> str:
        """This node's name, which the DRA plugin always has."""
        assert self.node_name is not None  # checked at construction
        return self.node_name

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
    def checkpoint_path(self) -> Path:
        return self.plugin_dir / "checkpoint.json"

    @property
    def claims_dir(self) -> Path:
        return self.host_root / "claims"

    @property
    def pool_name(self) -> str:
        return self.node
