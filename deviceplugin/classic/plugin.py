"""The device plugin's decisions: Allocate, PreStartContainer, and who does the rest.

Nothing here guesses which pod a call is for. Allocate records the IDs kubelet chose (counts: they
name no card) and the allocator places the container from its own ledger; PreStartContainer finds
the one container that holds exactly those IDs in kubelet's PodResources listing and writes what
its card is: the limits file and, through CDI, the card's device node. In the extender placement
mode the card is the one its pod's placement record names, read there (``records``).

The plugin coordinates the units that do the rest: the answers Allocate gives (``answers``), the
container's files on the host (``containerfiles``, which also shows the host layout), the early
verification ahead of PreStartContainer (``verifier``), and recovery and reconciliation with
kubelet's PodResources (``recovery``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path

from prometheus_client import CollectorRegistry

from core.dra import DRIVER
from deviceplugin._proto import deviceplugin_v1beta1_pb2 as pb
from deviceplugin.classic import checkpoint
from deviceplugin.classic.allocation import Allocation, AllocationError, container_dir_name
from deviceplugin.classic.allocator import Allocator
from deviceplugin.classic.answers import card_response, no_card, static_response
from deviceplugin.classic.config import Config
from deviceplugin.classic.containerfiles import CDI_KIND, ContainerFiles, cdi_spec_path
from deviceplugin.classic.directed import DirectedAllocator
from deviceplugin.classic.ids import Kind
from deviceplugin.classic.metrics import Metrics
from deviceplugin.classic.prestart import PreStartError
from deviceplugin.classic.reconciliation import Reconciled
from deviceplugin.classic.records import PodReader, RecordPlacement, RecordUnavailable
from deviceplugin.classic.recovery import Recovery
from deviceplugin.classic.verifier import EarlyVerifier
from deviceplugin.shared.hostfiles import install_preload
from deviceplugin.shared.inventory import Card
from deviceplugin.shared.podresources import ContainerDevices, PodResourcesClient, PodResourcesError
from deviceplugin.shared.uninstall import GRANT_DIRS, AgentFiles

log = logging.getLogger(__name__)


class NotListedError(RuntimeError):
    """PodResources does not (yet) list a container with these IDs: transient, kubelet retries."""


class WaitingError(RuntimeError):
    """No card can host the container yet: it waits (kubelet retries), it does not fail."""


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
        read_pod: PodReader | None = None,
    ) -> None:
        self.config = config
        self.cards = {c.index: c for c in cards}
        # extender placement: the card is its pod's record's, read from the API (records)
        self.records: RecordPlacement | None = None
        self.allocator: Allocator
        if config.placement == "extender":
            directed = DirectedAllocator(self.cards.values(), pair_window_s=config.pair_window_s)
            self.allocator = directed
            self.records = RecordPlacement(
                directed, read_pod or _no_api, node=config.node_name or "", cards=self.cards
            )
        else:
            self.allocator = Allocator(
                self.cards.values(), pair_window_s=config.pair_window_s, settle_s=config.settle_s
            )
        self.metrics = metrics or Metrics(CollectorRegistry())
        self.metrics.watch_cards(self.allocator.usage)
        self.podresources = podresources or PodResourcesClient(
            config.podresources_path, config.podresources_timeout_s
        )
        self.resources = {Kind.CORE: config.core_resource, Kind.MEMORY: config.memory_resource}
        self.checkpointer = checkpoint.CheckpointWriter(
            config.checkpoint_path, self.cards.values(), self.allocator.allocations
        )
        self.files = ContainerFiles(config, self.cards)
        self.recovery = Recovery(
            config,
            self.allocator,
            self.files,
            list_containers=self._list,
            save=self.save,
            direct=None if self.records is None else self.records.direct,
        )
        self.verifier = EarlyVerifier(
            self._verify_one,
            delay_s=config.verify_delay_s,
            retries=config.verify_retries,
            spacing_s=config.verify_spacing_s,
            stop_within_s=config.podresources_timeout_s + 1,
        )

    def resource(self, kind: Kind) -> str:
        return self.resources[kind]

    @property
    def reconciled(self) -> bool:
        """One successful reconciliation since start."""
        return self.recovery.reconciled

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

    def grant_dir(self, container: ContainerDevices) -> Path:
        """The limits directory of a container PodResources lists (the guard's grant)."""
        return self.files.grant_dir(container)

    def cards_of(self, core: Iterable[str]) -> tuple[int, ...] | None:
        """The cards a running container's limits file names (None: no readable file)."""
        return self.files.cards_of(core)

    def collect_dirs(self) -> list[str]:
        """Remove container directories that no allocation names (after a reconciliation)."""
        return self.recovery.collect_dirs()

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
                static_response(self.config, allocation.core, response)
                response.cdi_devices.add(name=f"{CDI_KIND}={container_dir_name(allocation.core)}")
        elif complete and (kind is Kind.CORE or allocation.core):
            if not allocation.cards:
                self.allocator.forget(allocation, why="no card can host it and CDI is off")
                raise AllocationError(f"{self.resource(kind)}: {self._no_card(allocation)}")
            static_response(self.config, allocation.core, response)
            card_response(self.config, self.cards, allocation, response)
        if complete and (allocation.cards or self.records is not None) and self.verifier.running:
            # both halves are in (or whole cards, which need no memory): prepare PreStart
            # (extender placement: it also reads the container's record and places it)
            self.verifier.submit(allocation)
        self.save()
        return response

    def _no_card(self, allocation: Allocation) -> str:
        usage = self.allocator.usage()
        directed = None if self.records is None else self.records.why_waiting(allocation, usage)
        return directed or no_card(allocation, usage)

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
            return self.files.write(None, known)
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
        if self.records is not None:
            self.records.direct(container, allocation)  # its record's cards, if they have room
        if not allocation.cards and allocation.placeable:
            # Admitted on capacity the ledger still gives to containers that may have ended:
            # believe this listing for them at once (kubelet is up: it is starting a container).
            self.recovery.reconcile(containers, time.time(), confirm_s=0.0)
        if not allocation.cards:
            self.save()
            if not allocation.placeable:
                self.files.write(container, allocation)  # raises the PreStartError
            self.metrics.waits.inc()
            raise WaitingError(
                f"{resource}: {container.namespace}/{container.pod} container "
                f"{container.container}: {self._no_card(allocation)}"
            )
        path = self.files.write(container, allocation)
        self.save()
        return path

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
        if self.records is not None:
            try:
                self.records.direct(container, verified)
            except RecordUnavailable as exc:  # PreStartContainer reads it again
                log.info("placement record not read early", extra={"error": str(exc)})
        if verified.cards:
            self.files.write(container, verified)
        return True

    # ---- state -------------------------------------------------------------------------

    def save(self) -> None:
        self.checkpointer.request()

    def recover(self) -> None:
        """Rebuild state after a start: checkpoint first, then PodResources (when it answers)."""
        self.recovery.recover()

    def reconcile_once(self) -> Reconciled:
        """Free what kubelet no longer lists, adopt what it lists, collect stale directories."""
        return self.recovery.reconcile_once()


def _no_api(namespace: str, name: str) -> None:
    raise RecordUnavailable(f"pod {namespace}/{name}: no API server to read its record from")


__all__ = [
    "DevicePlugin",
    "NotListedError",
    "WaitingError",
    "endpoint_socket",
]
