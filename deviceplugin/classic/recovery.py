"""The plugin's state after a start and on every reconciler pass: the checkpoint read back,
kubelet's PodResources listing followed, the limits files of listed containers restored and the
directories of ended ones collected.

The allocator decides what a listing frees and adopts (``reconciliation``); this unit feeds it,
writes what follows on the host and asks for a checkpoint when anything changed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from deviceplugin.classic import checkpoint
from deviceplugin.classic.allocation import Allocation
from deviceplugin.classic.allocator import Allocator
from deviceplugin.classic.config import Config
from deviceplugin.classic.containerfiles import ContainerFiles
from deviceplugin.classic.prestart import PreStartError
from deviceplugin.classic.reconciliation import Reconciled
from deviceplugin.classic.records import RecordError, RecordUnavailable
from deviceplugin.shared.podresources import ContainerDevices, PodResourcesError

# The plugin's logger, as before recovery was its own module: log filters name it.
log = logging.getLogger("deviceplugin.classic.plugin")


class Recovery:
    def __init__(
        self,
        config: Config,
        allocator: Allocator,
        files: ContainerFiles,
        *,
        list_containers: Callable[[], list[ContainerDevices]],
        save: Callable[[], None],
        direct: Callable[[ContainerDevices, Allocation], None] | None = None,
    ) -> None:
        self._config = config
        # extender placement: an adopted container with no limits file goes where its pod's
        # record says (``records.RecordPlacement.direct``), read here, outside the lock
        self._direct = direct
        self._allocator = allocator
        self._files = files
        self._list = list_containers
        self._save = save
        self.reconciled = False  # one successful reconciliation since start
        self._collected_at = -1  # allocator version at the last directory collection

    def recover(self) -> None:
        """Rebuild state after a start: checkpoint first, then PodResources (when it answers)."""
        try:
            restored = checkpoint.read(self._config.checkpoint_path, self._allocator.cards)
        except checkpoint.CheckpointError as exc:
            log.error("checkpoint ignored", extra={"error": str(exc)})
            restored = []
        self._allocator.restore(restored)
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
        return self.reconcile(self._list(), started, confirm_s=self._config.reconcile_confirm_s)

    def reconcile(
        self, containers: list[ContainerDevices], started: float, *, confirm_s: float
    ) -> Reconciled:
        """Follow one listing (``containers``, read at ``started``)."""
        config, allocator = self._config, self._allocator
        core, memory = config.core_resource, config.memory_resource
        listed = [(c.ids(core), c.ids(memory)) for c in containers]
        version = allocator.version
        settled = self._kubelet_settled(started)
        result = allocator.reconcile(
            listed,
            started,
            grace_s=config.reconcile_grace_s,
            confirm_s=confirm_s,
            may_free=settled,
            cards_of=self._files.cards_of,
        )
        first = not self.reconciled
        self.reconciled = True
        by_ids = {(c.ids(core), c.ids(memory)): c for c in containers}
        if self._direct is not None:
            self._direct_adopted(result.adopted, by_ids)
        # A container adopted from the listing (after a restart, or after a listing that
        # missed it) gets its limits file back, whatever happened to its directory meanwhile;
        # after a start, so does every container the checkpoint restored.
        for allocation in allocator.allocations() if first else result.adopted:
            holder = by_ids.get((frozenset(allocation.core), frozenset(allocation.memory)))
            if holder is not None and allocation.cards:
                self._restore_limits(holder, allocation)
        # Directories go stale only when an allocation goes (freed here, or replaced since the
        # last pass), and young ones are left for a later pass.
        if settled and (first or allocator.version != self._collected_at or self._files.young):
            self._collected_at = allocator.version
            self.collect_dirs()
        if first or allocator.version != version:
            self._save()
        return result

    def _direct_adopted(
        self,
        adopted: list[Allocation],
        by_ids: dict[tuple[frozenset[str], frozenset[str]], ContainerDevices],
    ) -> None:
        """Extender placement: adopted containers whose limits file named no card (a restart
        without the checkpoint) are placed by their pods' records, where they run or will."""
        assert self._direct is not None
        for allocation in adopted:
            holder = by_ids.get((frozenset(allocation.core), frozenset(allocation.memory)))
            if holder is None or allocation.cards:
                continue
            try:
                self._direct(holder, allocation)
            except (RecordError, RecordUnavailable) as exc:  # PreStartContainer asks again
                log.warning(
                    "adopted container not placed by its record",
                    extra={"pod": f"{holder.namespace}/{holder.pod}", "error": str(exc)},
                )

    def collect_dirs(self) -> list[str]:
        """Remove container directories that no allocation names (``ContainerFiles.collect``)."""
        return self._files.collect({a.dir_name for a in self._allocator.allocations()})

    def _kubelet_settled(self, now: float) -> bool:
        """Whether kubelet's PodResources socket is older than ``kubelet_settle_s``.

        kubelet makes the socket anew when it starts, and lists a pod only once it has read it
        back from its sources: until then an empty listing says nothing about running pods.
        """
        try:
            made = os.stat(self._config.podresources_path).st_ctime
        except OSError:
            return False
        return now - made >= self._config.kubelet_settle_s

    def _restore_limits(self, holder: ContainerDevices, allocation: Allocation) -> None:
        try:
            self._files.write(holder, allocation)
        except (PreStartError, OSError) as exc:
            log.warning(
                "limits of a listed container not restored",
                extra={"pod": f"{holder.namespace}/{holder.pod}", "error": str(exc)},
            )
            return
        allocation.verified = True
