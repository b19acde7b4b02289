"""The device plugin's decisions: Allocate, PreStartContainer, recovery and reconciliation.

Nothing here guesses which pod a call is for. Allocate records the IDs kubelet chose (counts: they
name no card) and the allocator places the container from its own ledger; PreStartContainer finds
the one container that holds exactly those IDs in kubelet's PodResources listing and writes what
its card is: the limits file and, through CDI, the card's device node.

Host layout under ``host_root`` (default ``/var/lib/fracgpu``)::

    lib/libfracgpu.so              the hook, installed by the DaemonSet; mounted read-only
    ld.so.preload                  names the hook's container path; mounted read-only
    containers/<dir>/limits/       the container's limits file; mounted read-only
    containers/<dir>/shared/       the hook's accounting region; mounted read-write
    checkpoint.json                this plugin's allocations

and ``<cdi_root>/fracgpu.io-container_<dir>.json``, the container's CDI spec (its card).

``<dir>`` is ``container_dir_name(core IDs)`` (see allocator.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

from prometheus_client import CollectorRegistry

from core import contract
from core.contract import VISIBLE_DEVICES_ENV
from core.dra import DRIVER
from core.units import BLOCK_MIB, CORE_PER_CARD, ENV_MEMORY_MIB, cards_phrase
from deviceplugin._proto import deviceplugin_v1beta1_pb2 as pb
from deviceplugin.classic import checkpoint
from deviceplugin.classic.allocator import (
    Allocation,
    AllocationError,
    Allocator,
    Reconciled,
    container_dir_name,
)
from deviceplugin.classic.config import Config
from deviceplugin.classic.ids import Kind
from deviceplugin.classic.metrics import Metrics
from deviceplugin.classic.prestart import PreStartError, limits_for
from deviceplugin.classic.verifier import EarlyVerifier
from deviceplugin.shared.cdispec import CDI_VERSION, CONTROL_DEVICES
from deviceplugin.shared.cdispec import write as write_cdi
from deviceplugin.shared.guard import GrantError
from deviceplugin.shared.hostfiles import install_preload, make_grant_dirs, write_limits
from deviceplugin.shared.inventory import Card
from deviceplugin.shared.podresources import ContainerDevices, PodResourcesClient, PodResourcesError
from deviceplugin.shared.uninstall import GRANT_DIRS, AgentFiles

log = logging.getLogger(__name__)

CDI_KIND = "fracgpu.io/container"
"""The CDI kind of device-plugin containers' specs: one device per container, named after its
directory."""


class NotListedError(RuntimeError):
    """PodResources does not (yet) list a container with these IDs: transient, kubelet retries."""


class WaitingError(RuntimeError):
    """No card can host the container yet: it waits (kubelet retries), it does not fail."""


def cdi_spec_path(cdi_root: Path, dir_name: str) -> Path:
    vendor, cls = CDI_KIND.split("/")
    return cdi_root / f"{vendor}-{cls}_{dir_name}.json"


def endpoint_socket(plugin_dir: Path, kind: Kind) -> Path:
    """The socket one resource is served on, in kubelet's device-plugin directory."""
    return plugin_dir / f"fracgpu-{kind.name.lower()}.sock"


class DevicePlugin:
    def __init__(
        self,
        config: Config,
        cards: Iterable[Card],
        *,
        metrics: Metrics | None = None,
        podresources: PodResourcesClient | None = None,
    ) -> None:
        self.config = config
        self.cards = {c.index: c for c in cards}
        self.allocator = Allocator(
            self.cards.values(), pair_window_s=config.pair_window_s, settle_s=config.settle_s
        )
        self.metrics = metrics or Metrics(CollectorRegistry())
        self.metrics.watch_cards(self.allocator.usage)
        self.podresources = podresources or PodResourcesClient(
            config.podresources_socket, config.podresources_timeout_s
        )
        self.resources = {Kind.CORE: config.core_resource, Kind.MEMORY: config.memory_resource}
        self.checkpointer = checkpoint.CheckpointWriter(
            config.checkpoint_path, self.cards.values(), self.allocator.allocations
        )
        self.reconciled = False  # one successful reconciliation since start
        self._collected_at = -1  # allocator version at the last directory collection
        self._young_dirs = False  # the last collection left directories to look at again
        self._orphans: dict[str, float] = {}  # directory -> when first found unnamed
        self.verifier = EarlyVerifier(
            self._verify_one,
            delay_s=config.verify_delay_s,
            retries=config.verify_retries,
            spacing_s=config.verify_spacing_s,
            stop_within_s=config.podresources_timeout_s + 1,
        )

    def resource(self, kind: Kind) -> str:
        return self.resources[kind]

    # ---- host files --------------------------------------------------------------------

    def install_host_files(self) -> None:
        """Write the ld.so.preload file that Allocate mounts, and the containers directory."""
        self.config.containers_dir.mkdir(parents=True, exist_ok=True)
        if self.config.cdi_root is not None:
            self.config.cdi_root.mkdir(parents=True, exist_ok=True)
        install_preload(self.config.ld_so_preload)

    def host_files(self) -> AgentFiles:
        """What this plugin writes on the node, which an uninstall removes (shared/uninstall)."""
        config = self.config
        return AgentFiles(
            host_root=config.host_root,
            grants=config.containers_dir,
            cdi_root=config.cdi_root,
            cdi_prefix=cdi_spec_path(Path(), "").name.removesuffix(".json"),
            sockets=tuple(endpoint_socket(config.plugin_dir, kind) for kind in Kind),
            checkpoint=config.checkpoint_path,
            foreign=tuple(
                config.host_root / name
                for name in GRANT_DIRS
                if config.host_root / name != config.containers_dir
            ),
        )

    def node_idle(self) -> bool | None:
        """Kubelet lists no container holding a fracgpu share of either mode (this plugin's
        resources, or a claim of fracgpu's DRA driver); None when it cannot be asked."""
        try:
            held = self.podresources.list(set(self.resources.values()), DRIVER)
        except PodResourcesError:
            return None
        return not held

    def running_dirs(self) -> set[str]:
        """The directories of the containers the ledger holds (shares that may still run)."""
        return {a.dir_name for a in self.allocator.allocations() if a.dir_name}

    def listed_dirs(self) -> set[str]:
        """At an uninstall: the directories of the containers kubelet lists now with this
        plugin's devices. The ledger frees an ended container only after a second listing
        confirms it gone, so a pod that ended just before the uninstall is still in it; kubelet's
        own list is final here, as nothing is admitted any more. When kubelet cannot be asked,
        the ledger's (more is kept, never less)."""
        try:
            containers = self._list()
        except PodResourcesError as err:
            log.warning("kubelet's PodResources unanswered at the stop; keeping the ledger's "
                        "shares", extra={"error": str(err)})  # fmt: skip
            return self.running_dirs()
        core = self.config.core_resource
        return {container_dir_name(c.ids(core)) for c in containers if c.ids(core)}

    def _container_dirs(self, core: Iterable[str]) -> tuple[Path, Path]:
        base = self.config.containers_dir / container_dir_name(core)
        return base / "limits", base / "shared"

    def _make_container_dirs(self, core: Iterable[str]) -> tuple[Path, Path]:
        """Create the container's directories (idempotent); the shared one is world-writable
        because the container's user, possibly not root, keeps its accounting there."""
        limits_dir, shared_dir = self._container_dirs(core)
        make_grant_dirs(limits_dir, shared_dir)
        return limits_dir, shared_dir

    # ---- Allocate ----------------------------------------------------------------------

    def allocate(self, kind: Kind, ids: list[str]) -> pb.ContainerAllocateResponse:
        """Serve one container of an Allocate call. AllocationError means: never retry.

        With CDI (the default) the answer never depends on the card: the core resource's answer
        carries the hook's mounts, the container's directories and a CDI device named after
        them, whose spec PreStartContainer writes once the card is known. The memory answer is
        empty (two answers mounting one container path would conflict). Without CDI the card
        must be in the answer, so the call that completes the container carries everything,
        and a container no card can host now is refused.
        """
        allocation = self.allocator.allocate(kind, ids, self.resource(kind))
        self.metrics.allocations.labels(self.resource(kind)).inc()
        response = pb.ContainerAllocateResponse()
        complete = allocation.placeable and (allocation.whole_cards_only or allocation.memory)
        if self.config.cdi_root is not None:
            if kind is Kind.CORE:
                self._static_response(allocation.core, response)
                response.cdi_devices.add(name=f"{CDI_KIND}={container_dir_name(allocation.core)}")
        elif complete and (kind is Kind.CORE or allocation.core):
            if not allocation.cards:
                self.allocator.forget(allocation, why="no card can host it and CDI is off")
                raise AllocationError(f"{self.resource(kind)}: {self._no_card(allocation)}")
            self._static_response(allocation.core, response)
            self._card_response(allocation, response)
        if complete and allocation.cards and self.verifier.running:
            # both halves are in (or whole cards, which need no memory): prepare PreStart
            self.verifier.submit(allocation)
        self.save()
        return response

    def _static_response(self, core: Iterable[str], response: pb.ContainerAllocateResponse) -> None:
        """What every fracgpu container gets, whichever card it lands on."""
        # Only named here: they are made with the limits file, by the early verification or by
        # PreStartContainer, which kubelet completes before it creates the container. Allocate
        # stays in memory, off the disk, while kubelet admits the pod.
        limits_dir, shared_dir = self._container_dirs(core)
        # The cards reach the container as the NVIDIA toolkit's device-list mounts, which only
        # the node agent can make; the variable names their directory and selects nothing by
        # itself, so one a user sets (envFrom) hands out no card (install guide).
        response.envs[VISIBLE_DEVICES_ENV] = contract.DEVICE_LIST_MOUNT_ROOT
        dev = self.config.dev_root
        for name in CONTROL_DEVICES:
            response.devices.add(
                container_path=f"/dev/{name}", host_path=str(dev / name), permissions="rw"
            )
        for host, path, read_only in (
            (self.config.hook_library, contract.CONTAINER_HOOK_LIBRARY, True),
            (self.config.ld_so_preload, contract.LD_SO_PRELOAD, True),
            (limits_dir, contract.CONTAINER_LIMITS_DIR, True),
            (shared_dir, contract.CONTAINER_SHARED_DIR, False),
        ):
            response.mounts.add(container_path=path, host_path=str(host), read_only=read_only)

    def _card_response(
        self, allocation: Allocation, response: pb.ContainerAllocateResponse
    ) -> None:
        """The card-specific part, in the Allocate answer (without CDI)."""
        cards = [self.cards[i] for i in allocation.cards]
        for card in cards:
            response.mounts.add(
                container_path=f"{contract.DEVICE_LIST_MOUNT_ROOT}/{card.uuid}",
                host_path=contract.DEVICE_LIST_HOST_PATH,
                read_only=True,
            )
            response.devices.add(
                container_path=f"/dev/nvidia{card.minor}",
                host_path=str(self.config.dev_root / f"nvidia{card.minor}"),
                permissions="rw",
            )
        if allocation.whole_cards_only:
            # Whole cards carry no memory resource: all of each card is theirs, and only the
            # node knows how much that is.
            response.envs[ENV_MEMORY_MIB] = str(min(c.memory_mib for c in cards))

    def _cdi_spec(self, allocation: Allocation) -> dict[str, object]:
        """The card-specific part as a CDI spec: the card's device node and device-list mount."""
        cards = [self.cards[i] for i in allocation.cards]
        edits: dict[str, object] = {
            "deviceNodes": [
                {
                    "path": f"/dev/nvidia{card.minor}",
                    "hostPath": str(self.config.dev_root / f"nvidia{card.minor}"),
                }
                for card in cards
            ],
            "mounts": [
                {
                    "hostPath": contract.DEVICE_LIST_HOST_PATH,
                    "containerPath": f"{contract.DEVICE_LIST_MOUNT_ROOT}/{card.uuid}",
                    "type": "bind",
                    "options": ["ro", "nosuid", "nodev", "bind"],
                }
                for card in cards
            ],
        }
        if allocation.whole_cards_only:
            edits["env"] = [f"{ENV_MEMORY_MIB}={min(c.memory_mib for c in cards)}"]
        return {
            "cdiVersion": CDI_VERSION,
            "kind": CDI_KIND,
            "devices": [{"name": container_dir_name(allocation.core), "containerEdits": edits}],
        }

    def _no_card(self, allocation: Allocation) -> str:
        """Why a container waits, in the user's units, with the closest card."""
        if allocation.whole_cards:
            n = allocation.whole_cards
            ask = f"{n} entirely free {'card' if n == 1 else 'cards'}"
        else:
            ask = (
                f"{cards_phrase(len(allocation.core))} and "
                f"{len(allocation.memory) * BLOCK_MIB} MiB of one card"
            )
        usage = self.allocator.usage()
        best = max(
            (u for u in usage if u.healthy),
            key=lambda u: (CORE_PER_CARD - u.core_used, u.blocks - u.memory_used),
            default=None,
        )
        closest = (
            "no card of this node is healthy"
            if best is None
            else f"the most free is {cards_phrase(CORE_PER_CARD - best.core_used)} and "
            f"{(best.blocks - best.memory_used) * BLOCK_MIB} MiB on card {best.card.index}"
        )
        return (
            f"no card of this node can host {ask} yet ({closest}): kubelet admitted the pod in "
            f"the moment after the node's capacity changed (pods ending or starting), when what "
            f"it counted free lay on several cards. It starts as soon as a share on this node "
            f"ends (kubelet retries every 10-15 s); delete the pod to have it scheduled elsewhere"
        )

    # ---- PreStartContainer -------------------------------------------------------------

    def _list(self) -> list[ContainerDevices]:
        return self.podresources.list(set(self.resources.values()))

    def prestart(self, kind: Kind, ids: list[str]) -> Path:
        """Write the limits (and CDI spec) of the container holding ``ids``; return the limits
        file.

        Raises PodResourcesError, NotListedError and WaitingError (transient) and PreStartError.
        """
        if not ids:
            raise PreStartError(f"{self.resource(kind)}: PreStartContainer named no device IDs")
        wanted = frozenset(ids)
        resource = self.resource(kind)
        known = self.allocator.find(kind, ids)
        held = None if known is None else (known.core if kind is Kind.CORE else known.memory)
        if known is not None and known.verified and known.cards and frozenset(held or ()) == wanted:
            # The second resource's call, or a container restart: PodResources already told
            # us which container holds exactly these IDs, and IDs are exclusive until kubelet
            # reassigns them (in an Allocate, which replaces this record).
            return self._write_files(None, known)
        containers = self._list()
        container = next((c for c in containers if c.ids(resource) == wanted), None)
        if container is None:
            raise NotListedError(
                f"{resource}: kubelet PodResources lists no container holding exactly "
                f"{sorted(wanted)[:4]}…; kubelet retries"
            )
        core = container.ids(self.config.core_resource)
        memory = container.ids(self.config.memory_resource)
        allocation = self.allocator.verify(core, memory)
        if not allocation.cards and allocation.placeable:
            # Admitted on capacity the ledger still gives to containers that may have ended:
            # believe this listing for them at once (kubelet is up: it is starting a container).
            self._reconcile(containers, time.time(), confirm_s=0.0)
        if not allocation.cards:
            self.save()
            if not allocation.placeable:
                self._write_files(container, allocation)  # raises the PreStartError
            self.metrics.waits.inc()
            raise WaitingError(
                f"{resource}: {container.namespace}/{container.pod} container "
                f"{container.container}: {self._no_card(allocation)}"
            )
        path = self._write_files(container, allocation)
        self.save()
        return path

    def _write_files(self, listed: ContainerDevices | None, allocation: Allocation) -> Path:
        """Write the limits file and CDI spec of a placed container (``listed``: as PodResources
        lists it, when it was just looked up).

        The log names the pod and the container PodResources lists with the IDs, not the
        container kubelet is starting: PreStartContainer names only IDs, and an init
        container's IDs are listed under the app container that reuses them (PodResources
        lists no plain init container).
        """
        dir_name = container_dir_name(allocation.core) if allocation.core else "(no core)"
        limits = limits_for(
            dir_name if listed is None else listed.name,
            len(allocation.core),
            len(allocation.memory),
            allocation.cards,
            self.cards,
            core_resource=self.config.core_resource,
            memory_resource=self.config.memory_resource,
        )
        limits_dir, _ = self._make_container_dirs(allocation.core)
        if self.config.cdi_root is not None:
            write_cdi(cdi_spec_path(self.config.cdi_root, dir_name), self._cdi_spec(allocation))
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
        core = container.ids(self.config.core_resource)
        if not core:
            raise GrantError(f"container {container.name} holds no {self.config.core_resource}")
        return self.config.containers_dir / container_dir_name(core) / "limits"

    def cards_of(self, core: Iterable[str]) -> tuple[int, ...] | None:
        """The cards a running container's limits file names (None: no readable file).

        After a restart without a checkpoint, this is where the container's card is recorded:
        its IDs name none.
        """
        limits_dir, _ = self._container_dirs(core)
        try:
            limits = contract.Limits.parse(
                (limits_dir / contract.LIMITS_FILE).read_text(encoding="ascii")
            )
        except (OSError, UnicodeDecodeError, contract.LimitsError):
            return None
        by_uuid = {card.uuid: card.index for card in self.cards.values()}
        found = tuple(by_uuid[u] for u in limits.devices if u in by_uuid)
        return found or None

    # ---- ahead of PreStartContainer -----------------------------------------------------

    def start_verifier(self) -> None:
        """Verify new allocations through PodResources before kubelet asks for PreStart
        (deviceplugin/classic/verifier.py)."""
        self.verifier.start()

    def stop_verifier(self) -> None:
        self.verifier.stop()

    def _verify_one(self, allocation: Allocation) -> bool:
        """True once PodResources lists one container with exactly this allocation's IDs.

        kubelet records each resource when its Allocate returns, so right after the second
        Allocate the container may still be listed with one resource only: then try again.
        """
        core, memory = frozenset(allocation.core), frozenset(allocation.memory)
        container = self.podresources.find(
            self.config.core_resource, core, set(self.resources.values())
        )
        if container is None or container.ids(self.config.memory_resource) != memory:
            return False
        verified = self.allocator.verify(core, memory)
        if verified.cards:
            self._write_files(container, verified)
        return True

    # ---- state -------------------------------------------------------------------------

    def save(self) -> None:
        self.checkpointer.request()

    def recover(self) -> None:
        """Rebuild state after a start: checkpoint first, then PodResources (when it answers)."""
        try:
            restored = checkpoint.read(self.config.checkpoint_path, self.cards)
        except checkpoint.CheckpointError as exc:
            log.error("checkpoint ignored", extra={"error": str(exc)})
            restored = []
        self.allocator.restore(restored)
        log.info("checkpoint restored", extra={"allocations": len(restored)})
        try:
            self.reconcile_once()
        except PodResourcesError as exc:
            log.warning("PodResources unavailable at start", extra={"error": str(exc)})

    def reconcile_once(self) -> Reconciled:
        """Free what kubelet no longer lists, adopt what it lists, collect stale directories.

        A pass that changes nothing writes nothing and scans no directory: on a busy node it
        runs beside Allocate and PreStartContainer, under the same interpreter lock.
        """
        started = time.time()
        return self._reconcile(self._list(), started, confirm_s=self.config.reconcile_confirm_s)

    def _reconcile(
        self, containers: list[ContainerDevices], started: float, *, confirm_s: float
    ) -> Reconciled:
        core, memory = self.config.core_resource, self.config.memory_resource
        listed = [(c.ids(core), c.ids(memory)) for c in containers]
        version = self.allocator.version
        settled = self._kubelet_settled(started)
        result = self.allocator.reconcile(
            listed,
            started,
            grace_s=self.config.reconcile_grace_s,
            confirm_s=confirm_s,
            may_free=settled,
            cards_of=self.cards_of,
        )
        first = not self.reconciled
        self.reconciled = True
        by_ids = {(c.ids(core), c.ids(memory)): c for c in containers}
        # A container adopted from the listing (after a restart, or after a listing that
        # missed it) gets its limits file back, whatever happened to its directory meanwhile;
        # after a start, so does every container the checkpoint restored.
        for allocation in self.allocator.allocations() if first else result.adopted:
            holder = by_ids.get((frozenset(allocation.core), frozenset(allocation.memory)))
            if holder is not None and allocation.cards:
                self._restore_limits(holder, allocation)
        # Directories go stale only when an allocation goes (freed here, or replaced since the
        # last pass), and young ones are left for a later pass.
        if settled and (first or self.allocator.version != self._collected_at or self._young_dirs):
            self._collected_at = self.allocator.version
            self.collect_dirs()
        if first or self.allocator.version != version:
            self.save()
        return result

    def _kubelet_settled(self, now: float) -> bool:
        """Whether kubelet's PodResources socket is older than ``kubelet_settle_s``.

        kubelet makes the socket anew when it starts, and lists a pod only once it has read it
        back from its sources: until then an empty listing says nothing about running pods.
        """
        try:
            made = os.stat(self.config.podresources_socket).st_ctime
        except OSError:
            return False
        return now - made >= self.config.kubelet_settle_s

    def _restore_limits(self, holder: ContainerDevices, allocation: Allocation) -> None:
        try:
            self._write_files(holder, allocation)
        except (PreStartError, OSError) as exc:
            log.warning(
                "limits of a listed container not restored",
                extra={"pod": f"{holder.namespace}/{holder.pod}", "error": str(exc)},
            )
            return
        allocation.verified = True

    def collect_dirs(self) -> list[str]:
        """Remove container directories that no allocation names (after a reconciliation).

        A directory is removed only when two collections at least ``reconcile_confirm_s``
        apart found it unnamed, and it is older than the grace period (it may belong to an
        Allocate that raced this collection).
        """
        live = {a.dir_name for a in self.allocator.allocations()}
        removed: list[str] = []
        root = self.config.containers_dir
        if not root.is_dir():
            return removed
        now = time.time()
        young = now - self.config.reconcile_grace_s
        self._young_dirs = False
        orphans: dict[str, float] = {}
        for entry in root.iterdir():
            if not entry.is_dir() or not entry.name.startswith("c-") or entry.name in live:
                continue
            first_seen = orphans[entry.name] = self._orphans.get(entry.name, now)
            if entry.stat().st_mtime > young or now - first_seen < self.config.reconcile_confirm_s:
                self._young_dirs = True  # look again at the next pass
                continue
            shutil.rmtree(entry, ignore_errors=True)
            if self.config.cdi_root is not None:
                cdi_spec_path(self.config.cdi_root, entry.name).unlink(missing_ok=True)
            del orphans[entry.name]
            removed.append(entry.name)
        self._orphans = orphans
        if removed:
            log.info("container directories collected", extra={"dirs": removed})
        return removed


__all__ = [
    "AllocationError",
    "DevicePlugin",
    "NotListedError",
    "PreStartError",
    "WaitingError",
    "endpoint_socket",
]
