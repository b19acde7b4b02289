"""The plugin's own checkpoint: which device IDs it allocated to which container directory.

Written after every change with temp file + fsync + rename + directory fsync, so a crash leaves the
old checkpoint or the new one. It records each card's UUID by index: a checkpoint written for
different cards (a card replaced under the same index) is refused rather than mis-mapped, and
recovery then relies on PodResources alone.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from core.units import CORE_PER_CARD, card_blocks
from deviceplugin.allocator import Allocation
from deviceplugin.ids import DeviceId, Kind
from deviceplugin.inventory import Card

log = logging.getLogger(__name__)

VERSION = 2
"""2: an allocation's ``cards`` are where the plugin placed it (its IDs name no card), and may
be empty (waiting for a card). Version 1, written while IDs named cards, is read as version 2:
its ``cards`` were the cards of its IDs, which is where those containers run."""
READABLE = (1, VERSION)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (corrupt, another version, other cards)."""


def write(path: Path, cards: Iterable[Card], allocations: Iterable[Allocation]) -> None:
    document = {
        "version": VERSION,
        "cards": {str(c.index): c.uuid for c in cards},
        "allocations": [a.to_json() for a in allocations],
    }
    write_document(path, document)


def write_document(path: Path, document: Mapping[str, Any], *, durable: bool = True) -> None:
    """Write a JSON checkpoint atomically: a reader sees the old file or the new one.

    ``durable`` (fsync of the file and its directory) makes that hold across a crash of the
    node too; without it a crash may leave the old file, or an empty one that reads as corrupt.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            # dumps, not dump: dump streams through the pure-Python encoder, several times
            # slower, and this runs beside the RPC handlers under the same interpreter lock
            fh.write(json.dumps(document, separators=(",", ":")))
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if not durable:
        return
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read(path: Path, cards: Mapping[int, Card]) -> list[Allocation]:
    """The allocations of a checkpoint written for these cards; [] when there is none."""
    try:
        document: Any = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} is unreadable: {exc}") from exc
    if not isinstance(document, dict) or document.get("version") not in READABLE:
        raise CheckpointError(f"checkpoint {path} has an unsupported format")
    expected = {str(i): c.uuid for i, c in cards.items()}
    recorded = document.get("cards")
    if recorded != expected:
        raise CheckpointError(
            f"checkpoint {path} was written for cards {recorded}, this node has {expected}"
        )
    records = document.get("allocations")
    if not isinstance(records, list):
        raise CheckpointError(f"checkpoint {path} has no list of allocations")
    allocations = []
    for number, record in enumerate(records):
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
