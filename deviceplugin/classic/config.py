"""Configuration of the device plugin (flags of ``fracgpu device-plugin``, and the tunables the
tests and the benchmark set).

The resource names and the memory block size are not settings: the webhook, quota and the hook
count in the same units, defined once in ``core.units``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from core import contract
from core.units import CORE, MEMORY
from deviceplugin.shared.flags import (
    DEFAULT_IGNORED_XIDS,
    KUBELET_PODRESOURCES_SOCKET,
    DaemonSetRef,
    GuardSettings,
)
from deviceplugin.shared.hostfiles import DEVICE_PLUGIN_CHECKPOINT, hook_library, ld_so_preload

KUBELET_DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
DEFAULT_RECONCILE_INTERVAL_S = 1.0


@dataclass(frozen=True, slots=True)
class Config:
    plugin_dir: Path = KUBELET_DEVICE_PLUGIN_DIR
    podresources_socket: Path = KUBELET_PODRESOURCES_SOCKET
    host_root: Path = Path(contract.HOST_ROOT)
    dev_root: Path = Path("/dev")
    # CDI directory of the runtime: the card is bound at PreStartContainer through a spec here;
    # None: named in the Allocate answer (runtimes without CDI; no waiting, see device-plugin.md)
    cdi_root: Path | None = Path("/var/run/cdi")
    ignored_xids: frozenset[int] = field(default_factory=lambda: frozenset(DEFAULT_IGNORED_XIDS))
    nvml_library: Path | None = None
    metrics_address: str = "0.0.0.0"
    metrics_port: int = 9402  # 0 disables the HTTP endpoint
    node_name: str | None = None  # publish inventory labels on this Node when set
    kubeconfig: Path | None = None  # None: in-cluster, then $KUBECONFIG, then ~/.kube/config
    # With node_name: write the Node's allocatable GPU resources as soon as they change, rather
    # than leave them to kubelet's node-status period (node.AllocatableMirror says why).
    node_allocatable: bool = True
    # after withdrawing the Node's allocatable at stop, keep serving this long: a pod the
    # scheduler bound just before is still admitted through this plugin, not refused by kubelet
    stop_drain_s: float = 2.0
    watch_interval_s: float = 0.25  # kubelet.sock / own socket polling
    # PodResources reconciliation: how often kubelet's List is read, and when a missing
    # container counts as gone (a second listing at least confirm_s after the first miss; never
    # within grace_s of its Allocate, which a List can race; never while kubelet's PodResources
    # socket is younger than settle_s, as a restarted kubelet lists its pods only once it has
    # read them back)
    reconcile_interval_s: float = DEFAULT_RECONCILE_INTERVAL_S
    reconcile_confirm_s: float = 0.5
    reconcile_grace_s: float = 2.0
    kubelet_settle_s: float = 30.0
    podresources_timeout_s: float = 5.0
    register_timeout_s: float = 10.0
    pair_window_s: float = 5.0
    settle_s: float = 2.0  # kubelet's lists kept from shrinking after a change hiding capacity
    # kubelet records a container's devices once its second Allocate has *answered*, so a List
    # at once mostly shows half of them: the early verifier's first look waits verify_delay_s,
    # then retries verify_retries times, verify_spacing_s apart, doubled after each miss
    verify_delay_s: float = 0.02
    verify_retries: int = 5
    verify_spacing_s: float = 0.05
    health_wait_ms: int = 200
    health_probe_interval_s: float = 5.0
    health_quiet_s: float = 30.0  # a card recovers after this long without a critical event
    health_error_backoff_s: float = 1.0  # pause after an NVML error before rebuilding events
    guard: GuardSettings = field(default_factory=GuardSettings)  # the node guard (shared/guard.py)
    # Its DaemonSet: stopped while that is gone or being deleted, the plugin removes its host
    # files (shared/uninstall.py); None: never. uninstall_timeout_s bounds the question at stop.
    daemonset: DaemonSetRef | None = None
    uninstall_timeout_s: float = 5.0

    @property
    def core_resource(self) -> str:
        return CORE

    @property
    def memory_resource(self) -> str:
        return MEMORY

    @property
    def checkpoint_path(self) -> Path:
        return self.host_root / DEVICE_PLUGIN_CHECKPOINT

    @property
    def containers_dir(self) -> Path:
        return self.host_root / "containers"

    @property
    def hook_library(self) -> Path:
        return hook_library(self.host_root)

    @property
    def ld_so_preload(self) -> Path:
        return ld_so_preload(self.host_root)
