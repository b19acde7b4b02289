"""The device plugin's decisions: Allocate, PreStartContainer, recovery and reconciliation.

Nothing here guesses which pod a call is for. Allocate reads the card and the amounts from the
device IDs kubelet chose; PreStartContainer finds the one container that holds exactly those IDs in
kubelet's PodResources listing and takes the rest of its devices from there.

Host layout under ``host_root`` (default ``/var/lib/fracgpu``)::

    lib/libfracgpu.so              the hook, installed by the DaemonSet; mounted read-only
    ld.so.preload                  names the hook's container path; mounted read-only
    containers/<dir>/limits/       the container's limits file; mounted read-only
    containers/<dir>/shared/       the hook's accounting region; mounted read-write
    checkpoint.json                this plugin's allocations

``<dir>`` is ``container_dir_name(core IDs)`` (see allocator.py).
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from prometheus_client import CollectorRegistry

from core import contract
from core.contract import VISIBLE_DEVICES_ENV
from core.units import ENV_MEMORY_MIB
from deviceplugin import checkpoint
from deviceplugin._proto import deviceplugin_v1beta1_pb2 as pb
from deviceplugin.allocator import (
    Allocation,
    AllocationError,
    Allocator,
    Reconciled,
    container_dir_name,
)
from deviceplugin.config import Config
from deviceplugin.ids import Kind
from deviceplugin.inventory import Card
from deviceplugin.metrics import Metrics
from deviceplugin.podresources import ContainerDevices, PodResourcesClient, PodResourcesError
from deviceplugin.prestart import PreStartError, limits_for

log = logging.getLogger(__name__)

NVIDIA_CONTROL_DEVICES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")


def install_preload(preload: Path) -> None:
    """Write the ``ld.so.preload`` file that containers get mounted over theirs (both modes)."""
    content = f"{contract.CONTAINER_HOOK_LIBRARY}\n"
    if not preload.exists() or preload.read_text() != content:
        preload.parent.mkdir(parents=True, exist_ok=True)
        tmp = preload.with_name(f".{preload.name}.tmp")
        tmp.write_text(content)
        os.chmod(tmp, 0o644)
        os.replace(tmp, preload)


def make_grant_dirs(limits_dir: Path, shared_dir: Path) -> None:
    """Create a grant's limits and accounting directories (idempotent). The accounting one is
    world-writable because the container's user, possibly not root, keeps its region there."""
    limits_dir.mkdir(parents=True, exist_ok=True)
    try:
        shared_dir.mkdir()
    except FileExistsError:
        return  # made before, with its mode
    os.chmod(shared_dir, 0o777)  # mkdir's mode is cut by the umask


class NotListedError(RuntimeError):
    """PodResources does not (yet) list a container with these IDs: transient, kubelet retries."""


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
        self.allocator = Allocator(self.cards.values(), pair_window_s=config.pair_window_s)
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
        self._verify: queue.Queue[tuple[Allocation, float] | None] = queue.Queue()
        self._verifier: threading.Thread | None = None

    def resource(self, kind: Kind) -> str:
        return self.resources[kind]

    # ---- host files --------------------------------------------------------------------

    def install_host_files(self) -> None:
        """Write the ld.so.preload file that Allocate mounts, and the containers directory."""
        self.config.containers_dir.mkdir(parents=True, exist_ok=True)
        install_preload(self.config.ld_so_preload)

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
        """Serve one container of an Allocate call. AllocationError means: never retry."""
        allocation = self.allocator.allocate(kind, ids, self.resource(kind))
        self.metrics.allocations.labels(self.resource(kind)).inc()
        response = pb.ContainerAllocateResponse()
        if kind is Kind.CORE:
            self._core_response(allocation, ids, response)
        complete = (allocation.core and allocation.memory) or allocation.whole_cards_only
        if complete and self._verifier is not None:
            # both halves are in (or whole cards, which need no memory): prepare PreStart
            self._verify.put((allocation, time.monotonic() + self.config.verify_delay_s))
        # The memory resource's response is empty on purpose: the core resource's response
        # already carries every mount, and two resources mounting the same container path
        # would conflict.
        self.save()
        return response

    def _core_response(
        self, allocation: Allocation, core: list[str], response: pb.ContainerAllocateResponse
    ) -> None:
        cards = [self.cards[i] for i in allocation.cards]
        # Only named here: they are made with the limits file, by the early verification or by
        # PreStartContainer, which kubelet completes before it creates the container. Allocate
        # stays in memory, off the disk, while kubelet admits the pod.
        limits_dir, shared_dir = self._container_dirs(core)
        # The cards reach the container as the NVIDIA toolkit's device-list mounts, which only
        # the node agent can make; the variable names their directory and selects nothing by
        # itself, so one a user sets (envFrom) hands out no card (install guide).
        response.envs[VISIBLE_DEVICES_ENV] = contract.DEVICE_LIST_MOUNT_ROOT
        for card in cards:
            response.mounts.add(
                container_path=f"{contract.DEVICE_LIST_MOUNT_ROOT}/{card.uuid}",
                host_path=contract.DEVICE_LIST_HOST_PATH,
                read_only=True,
            )
        if allocation.whole_cards_only:
            # Whole cards carry no memory resource: all of each card is theirs, and only the
            # node knows how much that is.
            response.envs[ENV_MEMORY_MIB] = str(min(c.memory_mib for c in cards))
        dev = self.config.dev_root
        for card in cards:
            path = f"/dev/nvidia{card.minor}"
            response.devices.add(
                container_path=path, host_path=str(dev / f"nvidia{card.minor}"), permissions="rw"
            )
        for name in NVIDIA_CONTROL_DEVICES:
            response.devices.add(
                container_path=f"/dev/{name}", host_path=str(dev / name), permissions="rw"
            )
        response.mounts.add(
            container_path=contract.CONTAINER_HOOK_LIBRARY,
            host_path=str(self.config.hook_library),
            read_only=True,
        )
        response.mounts.add(
            container_path=contract.LD_SO_PRELOAD,
            host_path=str(self.config.ld_so_preload),
            read_only=True,
        )
        response.mounts.add(
            container_path=contract.CONTAINER_LIMITS_DIR, host_path=str(limits_dir), read_only=True
        )
        response.mounts.add(
            container_path=contract.CONTAINER_SHARED_DIR, host_path=str(shared_dir), read_only=False
        )

    # ---- PreStartContainer -------------------------------------------------------------

    def _list(self) -> list[ContainerDevices]:
        return self.podresources.list(set(self.resources.values()))

    def prestart(self, kind: Kind, ids: list[str]) -> Path:
        """Write the limits of the container holding ``ids``; return the limits file.

        Raises PodResourcesError or NotListedError (transient) and PreStartError.
        """
        if not ids:
            raise PreStartError(f"{self.resource(kind)}: PreStartContainer named no device IDs")
        wanted = frozenset(ids)
        resource = self.resource(kind)
        known = self.allocator.find(kind, ids)
        held = None if known is None else (known.core if kind is Kind.CORE else known.memory)
        if known is not None and known.verified and frozenset(held or ()) == wanted:
            # The second resource's call, or a container restart: PodResources already told
            # us which container holds exactly these IDs, and IDs are exclusive until kubelet
            # reassigns them (in an Allocate, which replaces this record).
            return self._write_limits(None, known.core, known.memory)
        container = self.podresources.find(resource, wanted, set(self.resources.values()))
        if container is None:
            raise NotListedError(
                f"{resource}: kubelet PodResources lists no container holding exactly "
                f"{sorted(wanted)[:4]}…; kubelet retries"
            )
        core = container.ids(self.config.core_resource)
        memory = container.ids(self.config.memory_resource)
        path = self._write_limits(container, core, memory)
        before = len(self.allocator.allocations())
        self.allocator.verify(core, memory)
        if len(self.allocator.allocations()) != before or known is None:
            self.save()
        return path

    def _write_limits(
        self, listed: ContainerDevices | None, core: Iterable[str], memory: Iterable[str]
    ) -> Path:
        """Write the limits of the container holding these IDs (``listed``: as PodResources
        lists it, when it was just looked up).

        The log names the pod and the container PodResources lists with the IDs, not the
        container kubelet is starting: PreStartContainer names only IDs, and an init
        container's IDs are listed under the app container that reuses them (PodResources
        lists no plain init container).
        """
        dir_name = container_dir_name(core)
        limits = limits_for(
            dir_name if listed is None else listed.name,
            frozenset(core),
            frozenset(memory),
            self.cards,
            core_resource=self.config.core_resource,
            memory_resource=self.config.memory_resource,
        )
        limits_dir, _ = self._make_container_dirs(core)
        path = limits_dir / contract.LIMITS_FILE
        try:
            current = path.read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError):
            current = None
        if current != limits.render():  # PreStart repeats per resource and per restart
            limits.write_atomic(limits_dir)
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
        return path

    # ---- ahead of PreStartContainer -----------------------------------------------------

    def start_verifier(self) -> None:
        """Verify new allocations through PodResources before kubelet asks for PreStart.

        kubelet calls PreStartContainer well after admission (after the pod sandbox exists), so
        the List it needs can usually be done in between; PreStartContainer then only checks the
        limits file. When the verifier has not finished, PreStartContainer lists by itself.
        """
        self._verifier = threading.Thread(target=self._run_verifier, name="verify", daemon=True)
        self._verifier.start()

    def stop_verifier(self) -> None:
        if self._verifier is not None:
            self._verify.put(None)
            self._verifier.join(timeout=5)
            self._verifier = None

    def _run_verifier(self) -> None:
        while (item := self._verify.get()) is not None:
            allocation, due = item
            time.sleep(max(0.0, due - time.monotonic()))
            for attempt in range(self.config.verify_retries):
                if attempt:
                    time.sleep(self.config.verify_spacing_s * 2 ** (attempt - 1))
                if allocation.verified:
                    break  # PreStartContainer came first and listed it itself
                try:
                    if self._verify_one(allocation):
                        break
                except (PodResourcesError, PreStartError, OSError) as exc:
                    log.info("early verification skipped", extra={"error": str(exc)})
                    break
                except Exception:  # a bug here must not stop verifying later containers
                    log.exception("early verification failed")
                    break

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
        self._write_limits(container, core, memory)
        self.allocator.verify(core, memory)
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
        containers = self._list()
        core, memory = self.config.core_resource, self.config.memory_resource
        listed = [(c.ids(core), c.ids(memory)) for c in containers]
        version = self.allocator.version
        settled = self._kubelet_settled(started)
        result = self.allocator.reconcile(
            listed,
            started,
            grace_s=self.config.reconcile_grace_s,
            confirm_s=self.config.reconcile_confirm_s,
            may_free=settled,
        )
        first = not self.reconciled
        self.reconciled = True
        by_ids = {(c.ids(core), c.ids(memory)): c for c in containers}
        # A container adopted from the listing (after a restart, or after a listing that
        # missed it) gets its limits file back, whatever happened to its directory meanwhile;
        # after a start, so does every container the checkpoint restored.
        for allocation in self.allocator.allocations() if first else result.adopted:
            holder = by_ids.get((frozenset(allocation.core), frozenset(allocation.memory)))
            if holder is not None:
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
            self._write_limits(holder, allocation.core, allocation.memory)
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
    "install_preload",
    "make_grant_dirs",
]
