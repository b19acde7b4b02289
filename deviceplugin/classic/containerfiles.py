"""A container's files on the host: its directories, its limits file and its CDI spec, and the
collection of the directories no allocation names any more.

Host layout under ``host_root`` (default ``/var/lib/fracgpu``)::

    lib/libfracgpu.so              the hook, installed by the DaemonSet; mounted read-only
    ld.so.preload                  names the hook's container path; mounted read-only
    containers/<dir>/limits/       the container's limits file; mounted read-only
    containers/<dir>/shared/       the hook's accounting region; mounted read-write
    checkpoint.json                this plugin's allocations

and ``<cdi_root>/fracgpu.io-container_<dir>.json``, the container's CDI spec (its card).

``<dir>`` is ``container_dir_name(core IDs)`` (see ``allocation``): named after IDs, which name no
card, so the limits file in it is what says where the container runs.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from core import contract
from core.units import ENV_MEMORY_MIB
from deviceplugin.classic.allocation import Allocation, container_dir_name
from deviceplugin.classic.config import Config
from deviceplugin.classic.prestart import limits_for
from deviceplugin.shared.cdispec import CDI_VERSION
from deviceplugin.shared.cdispec import write as write_cdi
from deviceplugin.shared.guardowners import GrantError
from deviceplugin.shared.hostfiles import make_grant_dirs, write_limits
from deviceplugin.shared.inventory import Card
from deviceplugin.shared.podresources import ContainerDevices

# The plugin's logger, as before these files were their own module: log filters name it.
log = logging.getLogger("deviceplugin.classic.plugin")

CDI_KIND = "fracgpu.io/container"
"""The CDI kind of device-plugin containers' specs: one device per container, named after its
directory."""


def cdi_spec_path(cdi_root: Path, dir_name: str) -> Path:
    vendor, cls = CDI_KIND.split("/")
    return cdi_root / f"{vendor}-{cls}_{dir_name}.json"


def container_dirs(config: Config, core: Iterable[str]) -> tuple[Path, Path]:
    """The container's limits and shared directories (named only: nothing is made)."""
    base = config.containers_dir / container_dir_name(core)
    return base / "limits", base / "shared"


def cdi_spec(
    config: Config, cards: Mapping[int, Card], allocation: Allocation
) -> dict[str, object]:
    """The card-specific part as a CDI spec: the card's device node and device-list mount."""
    placed = [cards[i] for i in allocation.cards]
    edits: dict[str, object] = {
        "deviceNodes": [
            {
                "path": f"/dev/nvidia{card.minor}",
                "hostPath": str(config.dev_root / f"nvidia{card.minor}"),
            }
            for card in placed
        ],
        "mounts": [
            {
                "hostPath": contract.DEVICE_LIST_HOST_PATH,
                "containerPath": f"{contract.DEVICE_LIST_MOUNT_ROOT}/{card.uuid}",
                "type": "bind",
                "options": ["ro", "nosuid", "nodev", "bind"],
            }
            for card in placed
        ],
    }
    if allocation.whole_cards_only:
        edits["env"] = [f"{ENV_MEMORY_MIB}={min(c.memory_mib for c in placed)}"]
    return {
        "cdiVersion": CDI_VERSION,
        "kind": CDI_KIND,
        "devices": [{"name": container_dir_name(allocation.core), "containerEdits": edits}],
    }


class ContainerFiles:
    def __init__(self, config: Config, cards: Mapping[int, Card]) -> None:
        self._config = config
        self._cards = cards
        self._orphans: dict[str, float] = {}  # directory -> when first found unnamed
        self.young = False  # the last collection left directories to look at again

    def make_dirs(self, core: Iterable[str]) -> tuple[Path, Path]:
        """Create the container's directories (idempotent); the shared one is world-writable
        because the container's user, possibly not root, keeps its accounting there."""
        limits_dir, shared_dir = container_dirs(self._config, core)
        make_grant_dirs(limits_dir, shared_dir)
        return limits_dir, shared_dir

    def write(self, listed: ContainerDevices | None, allocation: Allocation) -> Path:
        """Write the limits file and CDI spec of a placed container (``listed``: as PodResources
        lists it, when it was just looked up); return the limits file.

        The log names the pod and the container PodResources lists with the IDs, not the
        container kubelet is starting: PreStartContainer names only IDs, and an init
        container's IDs are listed under the app container that reuses them (PodResources
        lists no plain init container).
        """
        config = self._config
        dir_name = container_dir_name(allocation.core) if allocation.core else "(no core)"
        limits = limits_for(
            dir_name if listed is None else listed.name,
            len(allocation.core),
            len(allocation.memory),
            allocation.cards,
            self._cards,
            core_resource=config.core_resource,
            memory_resource=config.memory_resource,
        )
        limits_dir, _ = self.make_dirs(allocation.core)
        if config.cdi_root is not None:
            write_cdi(
                cdi_spec_path(config.cdi_root, dir_name), cdi_spec(config, self._cards, allocation)
            )
        if write_limits(limits_dir, limits):  # PreStart repeats per resource and per restart
            where = (
                {}
                if listed is None
                else {
                    "pod": f"{listed.namespace}/{listed.pod}",
                    "listed_container": listed.container,
                }
            )
            log.info(
                "limits written",
                extra={
                    **where,
                    "devices": list(limits.devices),
                    "memory_bytes": limits.memory_bytes,
                    "compute_percent": limits.compute_percent,
                    "dir": limits_dir.parent.name,
                },
            )
        return limits_dir / contract.LIMITS_FILE

    def grant_dir(self, container: ContainerDevices) -> Path:
        """The limits directory of a container PodResources lists (the guard's grant): named
        after its core IDs, which name no card; the file in it says where it runs."""
        core_resource = self._config.core_resource
        core = container.ids(core_resource)
        if not core:
            raise GrantError(f"container {container.name} holds no {core_resource}")
        return self._config.containers_dir / container_dir_name(core) / "limits"

    def cards_of(self, core: Iterable[str]) -> tuple[int, ...] | None:
        """The cards a running container's limits file names (None: no readable file).

        After a restart without a checkpoint, this is where the container's card is recorded:
        its IDs name none.
        """
        limits_dir, _ = container_dirs(self._config, core)
        try:
            limits = contract.Limits.parse(
                (limits_dir / contract.LIMITS_FILE).read_text(encoding="ascii")
            )
        except (OSError, UnicodeDecodeError, contract.LimitsError):
            return None
        by_uuid = {card.uuid: card.index for card in self._cards.values()}
        found = tuple(by_uuid[u] for u in limits.devices if u in by_uuid)
        return found or None

    def collect(self, live: set[str | None]) -> list[str]:
        """Remove container directories that no allocation names (``live``: the names that
        allocations hold).

        A directory is removed only when two collections at least ``reconcile_confirm_s``
        apart found it unnamed, and it is older than the grace period (it may belong to an
        Allocate that raced this collection).
        """
        config = self._config
        removed: list[str] = []
        root = config.containers_dir
        if not root.is_dir():
            return removed
        now = time.time()
        young = now - config.reconcile_grace_s
        self.young = False
        orphans: dict[str, float] = {}
        for entry in root.iterdir():
            if not entry.is_dir() or not entry.name.startswith("c-") or entry.name in live:
                continue
            first_seen = orphans[entry.name] = self._orphans.get(entry.name, now)
            if entry.stat().st_mtime > young or now - first_seen < config.reconcile_confirm_s:
                self.young = True  # look again at the next pass
                continue
            shutil.rmtree(entry, ignore_errors=True)
            if config.cdi_root is not None:
                cdi_spec_path(config.cdi_root, entry.name).unlink(missing_ok=True)
            del orphans[entry.name]
            removed.append(entry.name)
        self._orphans = orphans
        if removed:
            log.info("container directories collected", extra={"dirs": removed})
        return removed
