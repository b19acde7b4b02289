"""The node guard's scan: each card's processes and their memory from NVML, each one's share of
the card's SMs, grouped by the grant that holds them.

The hook inside a container counts what the program allocates through the CUDA driver API; what
it cannot see (raw ioctls on the device nodes, a scribbled accounting region) still shows up in
the driver's own per-process accounting, which this module reads. A process is attributed
through /proc (guardproc.py) and the container's grant (guardowners.py); one that fails any step
(a system process, a container of another device plugin, a pod that holds no fracgpu resource)
belongs to no fracgpu container: it is counted, never acted on. A card NVML cannot read this
pass is marked failed, so that its excesses are neither started nor ended on no news.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import pynvml

from deviceplugin.shared.guardowners import Owners
from deviceplugin.shared.guardproc import ProcReader
from deviceplugin.shared.guardreport import GuardReport
from deviceplugin.shared.guardtypes import Observation, Owner, Process, Usage
from deviceplugin.shared.inventory import Card

# The guard's lines keep one logger, whichever of its modules writes them: operators and tests
# select the guard's log by this name.
log = logging.getLogger("deviceplugin.shared.guard")


def card_processes(card: Card, handle: Any = None) -> dict[int, int | None]:
    """pid -> bytes (None: NVML cannot tell) on one card, compute and graphics lists together.

    A process in both lists (a graphics context that also computes) appears with the same
    figure in each; it is counted once. ``handle``: the card's, when the caller has it.
    """
    if handle is None:
        handle = pynvml.nvmlDeviceGetHandleByUUID(card.uuid)
    merged: dict[int, int | None] = {}
    for info in (
        *pynvml.nvmlDeviceGetComputeRunningProcesses(handle),
        *pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle),
    ):
        pid = int(info.pid)
        used = None if info.usedGpuMemory is None else int(info.usedGpuMemory)
        if pid in merged and (used is None or (merged[pid] or 0) >= used):
            continue
        merged[pid] = used
    return merged


class Utilisation:
    """Each process's share of a card's SMs, from NVML's per-process samples.

    The driver keeps a few seconds of samples per card (one every ~1/6 s per active process);
    asking for those newer than the last one seen gives each scan the samples of its own
    interval, and a process's figure is the mean of its samples there. No sample for a process
    means it did not use the SMs (NVML answers NOT_FOUND when no process did).
    """

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}  # card UUID -> newest sample timestamp (µs)
        self._unsampled: set[str] = set()  # cards whose driver does not sample

    def read(self, card: Card, handle: Any) -> dict[int, float] | None:
        """pid -> percent busy since the previous read (None: this card is not sampled)."""
        if card.uuid in self._unsampled:
            return None
        try:
            samples = pynvml.nvmlDeviceGetProcessUtilization(handle, self._seen.get(card.uuid, 0))
        except pynvml.NVMLError_NotFound:
            return {}
        except pynvml.NVMLError_NotSupported:
            self._unsampled.add(card.uuid)
            log.info("card does not sample per-process utilisation", extra={"card": card.uuid})
            return None
        sums: dict[int, list[float]] = {}
        for sample in samples:
            sums.setdefault(int(sample.pid), []).append(float(sample.smUtil))
            self._seen[card.uuid] = max(self._seen.get(card.uuid, 0), int(sample.timeStamp))
        return {pid: sum(values) / len(values) for pid, values in sums.items()}


class ByGrant:
    """Processes grouped by grant and card, in the order first seen; a grant's owner is the
    first of its containers seen (the one logs and Events name)."""

    def __init__(self) -> None:
        self._owners: dict[str, Owner] = {}
        self._processes: dict[tuple[str, int], list[Process]] = {}

    def add(self, owner: Owner, card: int, process: Process) -> None:
        key = owner.grant or owner.name
        self._owners.setdefault(key, owner)
        self._processes.setdefault((key, card), []).append(process)

    def usage(self, cards: Mapping[int, Card]) -> list[Usage]:
        return [
            Usage(self._owners[key], cards[card], tuple(processes))
            for (key, card), processes in self._processes.items()
        ]


class Scanner:
    """One reading of every card, attributed: what the guard acts on and exports."""

    def __init__(
        self, cards: Mapping[int, Card], owners: Owners, proc: ProcReader, report: GuardReport
    ) -> None:
        self.cards = cards
        self.owners = owners
        self.proc = proc
        self.report = report
        self.utilisation = Utilisation()

    def observe(self) -> Observation:
        observation = Observation()
        grouped = ByGrant()
        for index, card in sorted(self.cards.items()):
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(card.uuid)
                processes = card_processes(card, handle)
            except pynvml.NVMLError as exc:
                self.report.card_unreadable(card, exc)
                observation.failed.add(index)
                continue
            self.report.card_readable(card)
            foreign = unmeasured = 0
            for pid, used in processes.items():
                if used is None:
                    unmeasured += 1
                    continue
                attributed = self.attribute(pid, used)
                if attributed is None:
                    foreign += 1
                    continue
                grouped.add(attributed[0], index, attributed[1])
            busy = self._busy(card, handle)
            if busy is not None:
                observation.busy[index] = busy
            observation.foreign[index] = foreign
            observation.unmeasured[index] = unmeasured
            self.report.card_counts(card, foreign=foreign, unmeasured=unmeasured)
        observation.usage = grouped.usage(self.cards)
        return observation

    def attribute(self, pid: int, used: int) -> tuple[Owner, Process] | None:
        """The fracgpu container holding ``pid`` and the process as seen now; None: no such
        container (a system process, a foreign pod) or the process is gone."""
        ref = self.proc.container(pid)
        owner = None if ref is None else self.owners.resolve(ref)
        start = self.proc.start_time(pid)
        if ref is None or owner is None or start is None:
            return None
        return owner, Process(pid, used, start, ref)

    def _busy(self, card: Card, handle: Any) -> dict[int, float] | None:
        try:
            return self.utilisation.read(card, handle)
        except pynvml.NVMLError as exc:  # the figure is for metrics only: never fatal
            log.debug("per-process utilisation unreadable", extra={"error": str(exc)})
            return None


__all__ = ["ByGrant", "Scanner", "Utilisation", "card_processes"]
