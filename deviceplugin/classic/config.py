"""Configuration of the device plugin (flags of ``fracgpu device-plugin``, and the tunables the
tests and the benchmark set).

The resource names and the memory block size are not settings: the webhook, quota and the hook
count in the same units, defined once in ``core.units``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from core.units import CORE, MEMORY
from deviceplugin.shared.hostfiles import DEVICE_PLUGIN_CHECKPOINT
from deviceplugin.shared.settings import (
    DEFAULT_CDI_ROOT,
    DEFAULT_KUBELET_ROOT,
    NodeSettings,
    SettingsError,
)

# Under kubelet's --root-dir, where kubelet watches for device plugins' sockets.
DEVICE_PLUGINS = Path("device-plugins")
KUBELET_DEVICE_PLUGIN_DIR = DEFAULT_KUBELET_ROOT / DEVICE_PLUGINS
DEFAULT_RECONCILE_INTERVAL_S = 1.0

Placement = Literal["node", "extender"]
"""Who chooses a container's card: ``node``, this plugin from its own ledger once kubelet has
admitted the container (the honesty rule keeps what the scheduler counts placeable); or
``extender``, fracgpu's scheduler extender at scheduling time, recorded on the pod, the plugin
only carrying it out (docs/device-plugin.md)."""
PLACEMENTS: tuple[Placement, ...] = ("node", "extender")


@dataclass(frozen=True, slots=True)
class Config(NodeSettings):
    """The device plugin's settings: the common node settings and what only this agent has."""

    # kubelet's device plugin directory (the CLI's default: <kubelet_root>/device-plugins)
    plugin_dir: Path = KUBELET_DEVICE_PLUGIN_DIR
    # CDI directory of the runtime: the card is bound at PreStartContainer through a spec here;
    # None: named in the Allocate answer (runtimes without CDI; no waiting, see device-plugin.md)
    cdi_root: Path | None = DEFAULT_CDI_ROOT
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
    register_timeout_s: float = 10.0
    pair_window_s: float = 5.0
    settle_s: float = 2.0  # kubelet's lists kept from shrinking after a change hiding capacity
    # kubelet records a container's devices once its second Allocate has *answered*, so a List
    # at once mostly shows half of them: the early verifier's first look waits verify_delay_s,
    # then retries verify_retries times, verify_spacing_s apart, doubled after each miss
    verify_delay_s: float = 0.02
    verify_retries: int = 5
    verify_spacing_s: float = 0.05
    placement: Placement = "node"
    # extender mode: how long reading a container's pod (its placement record) may take
    record_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        NodeSettings.__post_init__(self)
        if self.placement not in PLACEMENTS:
            raise SettingsError(f"placement {self.placement!r}: must be one of {PLACEMENTS}")
        if self.placement == "extender" and self.cdi_root is None:
            # Without CDI the card must be in the Allocate answer, and at Allocate kubelet has
            # not recorded the container yet: its pod, hence its record, cannot be known there
            # without guessing. With CDI the card is bound at PreStartContainer, where it can.
            raise SettingsError(
                "--placement extender needs CDI (drop --no-cdi): the card is read from the "
                "pod's placement record, which can be known only at PreStartContainer, and "
                "only CDI binds the card there; at Allocate kubelet names no pod"
            )
        if self.placement == "extender" and not self.node_name:
            raise SettingsError(
                "--placement extender needs --node-name (or $NODE_NAME): a placement record "
                "names the node it is for, and a record for another node is refused"
            )
        if not self.record_timeout_s > 0:
            raise SettingsError(f"record_timeout_s {self.record_timeout_s!r}: must be more than 0")

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
