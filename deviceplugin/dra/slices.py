"""The node's ResourceSlice: what DRA mode tells the scheduler about this node's cards.

One slice per node (pool = the node's name, owner = the Node, so it goes with the node), one
device per card named ``gpu-<index>``. Every device allows many allocations and has two
consumable capacities whose defaults are the whole card, so a claim that names no capacity (or
an extended-resource request) gets an exclusive card:

- ``cores``: 100, requests 1–100 in steps of 1 (percent of the card's compute);
- ``memory``: bytes, rounded down to a multiple of 256 MiB, requests in steps of 256 MiB.

An unhealthy card keeps its device (claims already on it still name it) and gets a NoSchedule
taint, so no new claim lands there.

kubelet deletes a node's slices when it starts and 30 s after a driver's last connection went
away, so :class:`SlicePublisher` watches its own slices and re-creates them at once. The API
server rewrites what it stores (quantities re-serialised, ``timeAdded`` filled in on taints),
so the comparison is semantic: quantities as numbers, taint times carried over from what is
stored. Otherwise every pass would see a difference and update forever.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import aiohttp

from core import dra
from core.informer import Informer, InformerSettings
from core.kube import (
    NODES,
    RESOURCE_SLICES,
    Api,
    KubeConflict,
    KubeError,
    KubeNotFound,
    Obj,
    RawBody,
    call_json,
)
from core.quantity import QuantityError, parse_quantity
from core.units import BLOCK_MIB, CORE_PER_CARD, MIB
from deviceplugin.shared.inventory import Card, CardDetails

log = logging.getLogger(__name__)

API_VERSION = dra.API_VERSION
MEMORY_STEP_BYTES = BLOCK_MIB * MIB
CORES = dra.CORES
MEMORY = dra.MEMORY
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
MAX_STRING_ATTRIBUTE = 64
TAINT_EFFECT = "NoSchedule"
_LABEL_VALUE_BAD = re.compile(r"[^A-Za-z0-9._-]+")


def device_name(index: int) -> str:
    return f"gpu-{index}"


def card_index(name: str) -> int | None:
    """The card index a device name stands for, or None when it is not one of ours."""
    match = re.fullmatch(r"gpu-(0|[1-9][0-9]{0,3})", name)
    return None if match is None else int(match[1])


def memory_capacity(card: Card) -> int:
    """The card's memory in bytes, rounded down to the request step (the scheduler's step
    arithmetic needs ``value - min`` to be a whole number of steps)."""
    return (card.memory_mib * MIB) // MEMORY_STEP_BYTES * MEMORY_STEP_BYTES


def _mib(value: int) -> str:
    return f"{value // MIB}Mi"


@dataclass(frozen=True, slots=True)
class CardState:
    card: Card
    details: CardDetails
    healthy: bool = True
    reason: str = ""


def taint_key(driver: str) -> str:
    return f"{driver}/unhealthy"


def _label_value(text: str) -> str:
    value = _LABEL_VALUE_BAD.sub("-", text.strip())[:63].strip("-_.")
    return value or "unhealthy"


def device(state: CardState, driver: str, driver_version: str | None) -> Obj:
    card = state.card
    memory = memory_capacity(card)
    attributes: Obj = {
        dra.UUID_ATTRIBUTE: {"string": card.uuid},
        dra.INDEX_ATTRIBUTE: {"int": card.index},
        dra.PRODUCT_ATTRIBUTE: {"string": card.product[:MAX_STRING_ATTRIBUTE]},
    }
    if state.details.pci_bus_id:
        attributes[PCI_BUS_ID] = {"string": state.details.pci_bus_id}
    if card.numa_node is not None:
        attributes["numaNode"] = {"int": card.numa_node}
    if state.details.compute_capability:
        attributes["computeCapability"] = {"string": state.details.compute_capability}
    if driver_version:
        attributes["driverVersion"] = {"string": driver_version[:MAX_STRING_ATTRIBUTE]}
    entry: Obj = {
        "name": device_name(card.index),
        "allowMultipleAllocations": True,
        "attributes": attributes,
        "capacity": {
            CORES: {
                "value": str(CORE_PER_CARD),
                "requestPolicy": {
                    "default": str(CORE_PER_CARD),
                    "validRange": {"min": "1", "max": str(CORE_PER_CARD), "step": "1"},
                },
            },
            MEMORY: {
                "value": _mib(memory),
                "requestPolicy": {
                    "default": _mib(memory),
                    "validRange": {
                        "min": _mib(MEMORY_STEP_BYTES),
                        "max": _mib(memory),
                        "step": _mib(MEMORY_STEP_BYTES),
                    },
                },
            },
        },
    }
    if not state.healthy:
        entry["taints"] = [
            {"key": taint_key(driver), "value": _label_value(state.reason), "effect": TAINT_EFFECT}
        ]
    return entry


def devices(states: Sequence[CardState], driver: str, driver_version: str | None) -> list[Obj]:
    """In card order: the scheduler places shares first-fit in device order."""
    ordered = sorted(states, key=lambda s: s.card.index)
    return [device(s, driver, driver_version) for s in ordered]


def desired_slice(
    *, node: str, node_uid: str, driver: str, generation: int, devices: list[Obj]
) -> Obj:
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {
            "generateName": f"{node}-{driver}-"[:200],
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "name": node,
                    "uid": node_uid,
                    "controller": True,
                }
            ],
        },
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


# ---- semantic comparison -------------------------------------------------------------------


def _number(raw: Any) -> Any:
    try:
        return parse_quantity(raw).value
    except QuantityError:
        return raw


def _canonical(value: Any, *, quantities: bool = False) -> Any:
    """A comparable form: quantities as exact numbers, taint times dropped, maps sorted."""
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if key == "timeAdded":
                continue
            quantity_field = quantities or key in ("capacity",)
            out[key] = _canonical(item, quantities=quantity_field)
        return out
    if isinstance(value, list):
        return [_canonical(item, quantities=quantities) for item in value]
    if quantities and isinstance(value, str | int) and not isinstance(value, bool):
        number = _number(value)
        return number if isinstance(number, Decimal) else value
    return value


def same_devices(stored: Sequence[Mapping[str, Any]], wanted: Sequence[Mapping[str, Any]]) -> bool:
    return bool(_canonical(list(stored)) == _canonical(list(wanted)))


def _taint_id(entry: Mapping[str, Any], taint: Mapping[str, Any]) -> tuple[Any, ...]:
    return (entry.get("name"), taint.get("key"), taint.get("value"), taint.get("effect"))


def carry_taint_times(stored: Sequence[Mapping[str, Any]], wanted: list[Obj]) -> None:
    """Keep the API server's ``timeAdded`` on taints that are still there."""
    times = {
        _taint_id(entry, taint): taint["timeAdded"]
        for entry in stored
        for taint in entry.get("taints") or []
        if taint.get("timeAdded")
    }
    for entry in wanted:
        for taint in entry.get("taints") or []:
            added = times.get(_taint_id(entry, taint))
            if added:
                taint["timeAdded"] = added


def _generation(obj: Mapping[str, Any]) -> int:
    return int(((obj.get("spec") or {}).get("pool") or {}).get("generation") or 0)


# ---- the publisher -------------------------------------------------------------------------


@dataclass
class PublisherStats:
    creates: int = 0
    updates: int = 0
    deletes: int = 0
    errors: int = 0


class SlicePublisher:
    """Keeps exactly one ResourceSlice for (node, driver) equal to the cards' current state.

    Runs on the daemon's event loop. ``poke()`` (thread-safe through the loop) asks for a pass;
    every watch event on the node's slices is a poke too, so a wiped slice is re-created as soon
    as the DELETED event arrives.
    """

    def __init__(
        self,
        api: Api,
        *,
        node: str,
        driver: str,
        states: Callable[[], Sequence[CardState]],
        driver_version: str | None,
        resync_s: float = 30.0,
        backoff_max_s: float = 10.0,
        on_publish: Callable[[str], None] | None = None,
    ) -> None:
        self.api = api
        self.node = node
        self.driver = driver
        self._states = states
        self.driver_version = driver_version
        self.resync_s = resync_s
        self.backoff_max_s = backoff_max_s
        self._on_publish = on_publish
        self.generation = 0
        self._last: list[Obj] | None = None  # the devices last written
        self.node_uid = ""
        self.stats = PublisherStats()
        self._dirty = asyncio.Event()
        self.informer = Informer(
            api,
            RESOURCE_SLICES,
            field_selector=f"spec.nodeName={node},spec.driver={driver}",
            handler=self._on_event,
            name="resourceslices",
            settings=InformerSettings(backoff_max_s=backoff_max_s),
        )
        self.in_sync = asyncio.Event()  # set after a pass found the slice as wanted
        # Our last write, until the watch has shown it: (name, resourceVersion, when). A pass
        # before that would read a cache without it and create a second slice.
        self._pending: tuple[str, str, float] | None = None
        self.pending_limit_s = 5.0  # a watch that shows nothing this long is not waited for
        self._task: asyncio.Task[None] | None = None

    def poke(self) -> None:
        self._dirty.set()

    def _on_event(self, kind: str, obj: RawBody) -> None:
        meta = obj.get("metadata") or {}
        pending = self._pending
        if (
            pending is not None
            and meta.get("name") == pending[0]
            and (kind == "DELETED" or meta.get("resourceVersion") == pending[1])
        ):
            self._pending = None
        self._dirty.set()

    def _wrote(self, written: dict[str, Any]) -> None:
        name = str(written["metadata"]["name"])
        version = str(written["metadata"].get("resourceVersion") or "")
        seen = self.informer.get(name)
        if seen is not None and (seen.get("metadata") or {}).get("resourceVersion") == version:
            self._pending = None  # the watch was faster than our own answer
        else:
            self._pending = (name, version, time.monotonic())

    def _waiting_for_watch(self) -> bool:
        if self._pending is None:
            return False
        if time.monotonic() - self._pending[2] > self.pending_limit_s:
            log.warning(
                "the ResourceSlice watch has not shown our write; going on without it",
                extra={"slice": self._pending[0], "node": self.node},
            )
            self._pending = None
            return False
        return True

    async def start(self) -> None:
        self.informer.start()
        self._dirty.set()
        self._task = asyncio.create_task(self._run(), name="slice-publisher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.informer.stop()

    async def _run(self) -> None:
        backoff = 0.2
        while True:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancellation
            # that arrives as the event is set, and stop() then waits for this loop forever.
            with suppress(TimeoutError):
                async with asyncio.timeout(self.resync_s):
                    await self._dirty.wait()
            self._dirty.clear()
            try:
                await self.informer.wait_synced()
                await self.sync_once()
                backoff = 0.2
            except asyncio.CancelledError:
                raise
            except KubeConflict:
                # The cache is behind our own write or kubelet's; the watch event re-pokes.
                self._dirty.set()
                await asyncio.sleep(0.05)
            except (KubeError, aiohttp.ClientError, OSError, TimeoutError) as exc:
                self.stats.errors += 1
                log.warning(
                    "publishing the ResourceSlice failed; retrying",
                    extra={"node": self.node, "driver": self.driver, "error": str(exc)},
                )
                self._dirty.set()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)

    async def _node_uid(self) -> str:
        if not self.node_uid:
            try:
                node = await call_json(self.api, "GET", NODES.path(name=self.node))
            except KubeNotFound as exc:
                raise KubeNotFound(
                    exc.status,
                    exc.reason,
                    f"Node {self.node!r} does not exist, so its ResourceSlice cannot be owned by "
                    "it; --node-name (or NODE_NAME, which the DaemonSet sets from "
                    "spec.nodeName) must name this node",
                ) from exc
            self.node_uid = str(node["metadata"]["uid"])
        return self.node_uid

    async def sync_once(self) -> None:
        """One pass: create, update or trim the node's slices to exactly the wanted one.

        The pool generation goes up whenever the devices change, so the scheduler, which reads
        only a pool's newest generation, never mixes an old view of a card with a new one.
        """
        if self._waiting_for_watch():
            return  # its event pokes the next pass
        wanted = devices(self._states(), self.driver, self.driver_version)
        stored = sorted(
            self.informer.objects(),
            key=lambda o: (-_generation(o), o["metadata"].get("name", "")),
        )
        self.in_sync.clear()
        if not stored:
            if self._last is None or not same_devices(self._last, wanted):
                self.generation += 1
            body = desired_slice(
                node=self.node,
                node_uid=await self._node_uid(),
                driver=self.driver,
                generation=self.generation,
                devices=wanted,
            )
            created = await call_json(self.api, "POST", RESOURCE_SLICES.path(), body=body)
            self._wrote(created)
            self._last = wanted
            self.stats.creates += 1
            log.info(
                "ResourceSlice created",
                extra={
                    "slice": created["metadata"]["name"],
                    "node": self.node,
                    "generation": self.generation,
                    "devices": len(wanted),
                },
            )
            self._published("create")
            self.in_sync.set()
            return
        keep, extra = stored[0], stored[1:]
        for other in extra:
            await self._delete(other)
        spec = keep.get("spec") or {}
        current = spec.get("devices") or []
        count = int((spec.get("pool") or {}).get("resourceSliceCount", 0))
        self.generation = max(self.generation, _generation(keep))
        unchanged = same_devices(current, wanted)
        if unchanged and count == 1:
            self._last = wanted
            self.in_sync.set()
            return
        carry_taint_times(current, wanted)
        if not unchanged:
            self.generation += 1
        updated = dict(keep)
        updated["spec"] = {
            **spec,
            "pool": {"name": self.node, "generation": self.generation, "resourceSliceCount": 1},
            "devices": wanted,
        }
        name = keep["metadata"]["name"]
        self._wrote(await call_json(self.api, "PUT", RESOURCE_SLICES.path(name=name), body=updated))
        self._last = wanted
        self.stats.updates += 1
        log.info(
            "ResourceSlice updated",
            extra={"slice": name, "node": self.node, "generation": self.generation},
        )
        self._published("update")
        self.in_sync.set()

    async def _delete(self, obj: RawBody) -> None:
        name = obj["metadata"]["name"]
        try:
            await call_json(
                self.api,
                "DELETE",
                RESOURCE_SLICES.path(name=name),
                body={"preconditions": {"uid": obj["metadata"]["uid"]}},
            )
        except KubeNotFound:
            return
        self.stats.deletes += 1
        log.info("surplus ResourceSlice deleted", extra={"slice": name, "node": self.node})

    def _published(self, how: str) -> None:
        if self._on_publish is not None:
            self._on_publish(how)

    async def delete_all(self) -> None:
        """Remove this node's slices for the driver (an operator's clean uninstall)."""
        for obj in list(self.informer.objects()):
            await self._delete(obj)
