"""The plugin's own checkpoint: which device IDs it allocated to which container directory.

Written after every change with temp file + fsync + rename + directory fsync, so a crash leaves the
old checkpoint or the new one. It records each card's UUID by index: a checkpoint written for
different cards (a card replaced under the same index) is refused rather than mis-mapped, and
recovery then relies on PodResources alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from core.units import CORE_PER_CARD, card_blocks
from deviceplugin.classic.allocation import Allocation
from deviceplugin.classic.ids import DeviceId, Kind
from deviceplugin.shared import checkpoint as versioned
from deviceplugin.shared.checkpoint import CheckpointError
from deviceplugin.shared.inventory import Card

log = logging.getLogger(__name__)

VERSION = 2


class DevicePluginCheckpoint(versioned.Document):
    """Version 2: an allocation's ``cards`` are where the plugin placed it (its IDs name no
    card), and may be empty (waiting for a card).

    Allocations stay plain records here and are parsed one by one in ``read``: one bad record
    must not cost the others (the plugin would crash-loop until someone deleted the file).
    """

    version: Literal[2]
    cards: dict[str, str]  # index -> UUID of the cards it was written for
    allocations: list[Any]


def _from_v1(document: dict[str, Any]) -> dict[str, Any]:
    """Version 1 was written while IDs named cards; its ``cards`` were the cards of its IDs,
    which is where those containers run, so it reads as version 2 unchanged."""
    return {**document, "version": 2}


UPGRADES: Mapping[int, versioned.Upgrade] = {1: _from_v1}


def write(path: Path, cards: Iterable[Card], allocations: Iterable[Allocation]) -> None:
    document = DevicePluginCheckpoint(
        version=VERSION,
        cards={str(c.index): c.uuid for c in cards},
        allocations=[a.to_json() for a in allocations],
    )
    versioned.write(path, document)


def read(path: Path, cards: Mapping[int, Card]) -> list[Allocation]:
    """The allocations of a checkpoint written for these cards; [] when there is none."""
    document = versioned.read(path, DevicePluginCheckpoint, upgrades=UPGRADES)
    if document is None:
        return []
    expected = {str(i): c.uuid for i, c in cards.items()}
    if document.cards != expected:
        raise CheckpointError(
            f"checkpoint {path} was written for cards {document.cards}, this node has {expected}"
        )
    allocations = []
    for number, record in enumerate(document.allocations):
        # One bad record must not stop the plugin (a crash loop until someone deletes the file):
        # it is dropped, and PodResources tells recovery what that container holds.
        try:
            allocations.append(_valid(Allocation.from_json(record), cards))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            log.warning(
                "checkpoint record dropped",
                extra={"path": str(path), "record": number, "error": str(exc)[:200]},
            )
    return allocations


def _valid(allocation: Allocation, cards: Mapping[int, Card]) -> Allocation:
    """The allocation, if every ID is one this plugin advertises; else ValueError."""
    for kind, ids in ((Kind.CORE, allocation.core), (Kind.MEMORY, allocation.memory)):
        for text in ids:
            parsed = DeviceId.parse(text)  # DeviceIdError is a ValueError
            card = cards.get(parsed.card)
            total = 0 if card is None else card_blocks(card.memory_mib)
            if kind is Kind.CORE and card is not None:
                total = CORE_PER_CARD
            if parsed.kind is not kind or parsed.number >= total:
                raise ValueError(f"{text!r} is no {kind.name.lower()} device ID of this node")
    if not allocation.core and not allocation.memory:
        raise ValueError("the allocation holds no device IDs")
    return allocation


class CheckpointWriter:
    """Writes the checkpoint off the RPC path: Allocate marks it dirty, a thread writes it.

    Coalescing (at most one write per ``min_interval_s``) keeps the fsyncs and the JSON work out
    of kubelet's Allocate latency. A crash before the write loses
    nothing that matters: kubelet records every allocation it made and lists it in PodResources,
    from which recovery adopts what the checkpoint lacks. ``flush`` writes synchronously (stop).
    Until ``start`` is called, ``request`` writes synchronously.
    """

    def __init__(
        self,
        path: Path,
        cards: Iterable[Card],
        snapshot: Callable[[], list[Allocation]],
        *,
        min_interval_s: float = 0.1,
    ) -> None:
        self.path = path
        self.min_interval_s = min_interval_s
        self.cards = list(cards)
        self._snapshot = snapshot
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.writes = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="checkpoint", daemon=True)
        self._thread.start()

    def request(self) -> None:
        if self._thread is None:
            self.flush()
        else:
            self._dirty.set()

    def flush(self) -> None:
        with self._lock:
            self._dirty.clear()
            write(self.path, self.cards, self._snapshot())
            self.writes += 1

    def stop(self) -> None:
        self._stop.set()
        self._dirty.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self.flush()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._dirty.wait()
            if self._stop.is_set():
                return
            try:
                self.flush()
                # A burst of Allocates (a pod's containers) is written once, not per call.
                self._stop.wait(self.min_interval_s)
            except OSError as exc:
                log.error("checkpoint write failed; retrying", extra={"error": str(exc)})
                self._stop.wait(1.0)
                self._dirty.set()


__all__ = [
    "VERSION",
    "CheckpointError",
    "CheckpointWriter",
    "DevicePluginCheckpoint",
    "read",
    "write",
]
