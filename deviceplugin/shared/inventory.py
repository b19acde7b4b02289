"""The node's cards, as NVML reports them (through pynvml).

``load_nvml`` lets the operator (and the tests) name the NVML library file: it is loaded by
path first, and because it carries the soname ``libnvidia-ml.so.1``, pynvml's own
``CDLL("libnvidia-ml.so.1")`` then resolves to the same, already loaded object.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pynvml

log = logging.getLogger(__name__)

NVML_SONAME = "libnvidia-ml.so.1"


class InventoryError(RuntimeError):
    """NVML could not be loaded or did not describe the node's cards."""


@dataclass(frozen=True, slots=True)
class Card:
    index: int
    uuid: str
    product: str
    memory_mib: int
    minor: int
    numa_node: int | None  # None: NVML does not know (single-socket hosts, VMs)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def load_nvml(library: Path | None) -> None:
    """Load NVML (from ``library`` when given) and initialise it. Raises InventoryError."""
    if library is not None:
        try:
            ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            raise InventoryError(f"cannot load NVML library {library}: {exc}") from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise InventoryError(f"NVML initialisation failed: {exc}") from exc


def shutdown_nvml() -> None:
    try:
        pynvml.nvmlShutdown()
    except pynvml.NVMLError as exc:
        log.warning("NVML shutdown failed", extra={"error": str(exc)})


def _numa_node(handle: Any) -> int | None:
    try:
        node = int(pynvml.nvmlDeviceGetNumaNodeId(handle))
    except pynvml.NVMLError:
        return None
    return node if node >= 0 else None


def discover() -> list[Card]:
    """Describe every card NVML sees. NVML must be initialised (``load_nvml``)."""
    try:
        count = int(pynvml.nvmlDeviceGetCount())
        cards = []
        for index in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            cards.append(
                Card(
                    index=index,
                    uuid=str(pynvml.nvmlDeviceGetUUID(handle)),
                    product=str(pynvml.nvmlDeviceGetName(handle)),
                    memory_mib=int(memory.total) // 2**20,
                    minor=int(pynvml.nvmlDeviceGetMinorNumber(handle)),
                    numa_node=_numa_node(handle),
                )
            )
    except pynvml.NVMLError as exc:
        raise InventoryError(f"NVML inventory failed: {exc}") from exc
    log.info("inventory", extra={"cards": [c.to_json() for c in cards]})
    return cards


@dataclass(frozen=True, slots=True)
class CardDetails:
    """What NVML may also say about a card; None where this driver or card does not say it."""

    pci_bus_id: str | None
    compute_capability: str | None  # "9.0"


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def details(card: Card) -> CardDetails:
    """Optional facts about a card (DRA attributes); NVML must be initialised."""
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(card.uuid)
    except pynvml.NVMLError:
        return CardDetails(None, None)
    try:
        bus: str | None = _text(pynvml.nvmlDeviceGetPciInfo(handle).busId).lower()
    except pynvml.NVMLError:
        bus = None
    try:
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        capability: str | None = f"{int(major)}.{int(minor)}"
    except pynvml.NVMLError:
        capability = None
    return CardDetails(bus, capability)


def driver_version() -> str | None:
    try:
        return _text(pynvml.nvmlSystemGetDriverVersion())
    except pynvml.NVMLError:
        return None
