"""Publishing the node's cards on its Node object, for the webhook, schedulers and people.

Two writers live here. :class:`NodePublisher` keeps the labels and the inventory annotation;
:class:`AllocatableMirror` keeps the Node's allocatable ``fracgpu.io/core`` and
``fracgpu.io/memory`` equal to what the plugin advertises, at once (see its docstring for why).

Labels (selectable): ``fracgpu.io/gpu.product`` (label-safe product name; ``mixed`` when cards
differ), ``fracgpu.io/gpu.memory-mib`` (memory of the smallest card, the most a container can
count on), ``fracgpu.io/gpu.count``. Annotation ``fracgpu.io/gpu.inventory``: versioned JSON with
every card (index, uuid, product, memoryMiB, minor, numaNode, healthy).

Annotation ``fracgpu.io/gpu.free``: versioned JSON with what each card has free
(``{"version":1,"cards":[{"index","cores","memoryMiB"}]}``; a failed card has nothing free), from
the plugin's ledger, for the webhook to tell a pod that waits Pending why, in its units.

Written with one JSON merge patch (labels and the annotations together), again whenever a card's
health changes or, at most once a second, what the cards have free, and retried with backoff
while the API server is unreachable.

The plugin is threaded (gRPC's server runs handlers on threads), so each writer is a plain thread
that decides *when* to write, and every write runs on the agent's one API thread
(``shared.apiloop.ApiLoop``: one event loop, one client, made afresh after a failure, so a
rotated service-account token is picked up).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any

from core.kube import NODES, Api, call_json
from core.labels import (
    COUNT_LABEL,
    FREE_ANNOTATION,
    FREE_VERSION,
    INVENTORY_ANNOTATION,
    INVENTORY_VERSION,
    MEMORY_LABEL,
    PRODUCT_LABEL,
    label_value,
)
from core.units import BLOCK_MIB, CORE_PER_CARD
from deviceplugin.classic.allocator import Allocator
from deviceplugin.classic.config import Config
from deviceplugin.classic.ids import Kind
from deviceplugin.classic.ledger import CardUsage
from deviceplugin.shared.apiloop import ApiLoop
from deviceplugin.shared.inventory import Card

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
WRITE_TIMEOUT_S = 10.0  # one PATCH; a writer retries after a failure


def label_safe(text: str) -> str:
    """A label value (≤ 63 chars of [A-Za-z0-9._-], alphanumeric at both ends)."""
    return label_value(text)


def free_annotation(usage: Iterable[CardUsage]) -> str:
    """What each card has free, as the ``fracgpu.io/gpu.free`` annotation says it."""
    cards = [
        {
            "index": u.card.index,
            "cores": CORE_PER_CARD - u.core_used if u.healthy else 0,
            "memoryMiB": (u.blocks - u.memory_used) * BLOCK_MIB if u.healthy else 0,
        }
        for u in sorted(usage, key=lambda u: u.card.index)
    ]
    return json.dumps({"version": FREE_VERSION, "cards": cards}, separators=(",", ":"))


FREE_INTERVAL_S = 1.0
"""At most one write of what the cards have free per this long: a busy node changes it at every
allocation, and the reader (an explanation for a waiting pod) needs no more."""


def node_patch(
    cards: Iterable[Card], healthy: dict[int, bool], free: str | None = None
) -> dict[str, Any]:
    cards = sorted(cards, key=lambda c: c.index)
    products = {c.product for c in cards}
    labels = {
        COUNT_LABEL: str(len(cards)),
        PRODUCT_LABEL: label_safe(products.pop()) if len(products) == 1 else "mixed",
        MEMORY_LABEL: str(min(c.memory_mib for c in cards)) if cards else "0",
    }
    inventory = {
        "version": INVENTORY_VERSION,
        "cards": [
            {
                "index": c.index,
                "uuid": c.uuid,
                "product": c.product,
                "memoryMiB": c.memory_mib,
                "minor": c.minor,
                "numaNode": c.numa_node,
                "healthy": healthy.get(c.index, False),
            }
            for c in cards
        ],
    }
    annotations = {INVENTORY_ANNOTATION: json.dumps(inventory, separators=(",", ":"))}
    if free is not None:
        annotations[FREE_ANNOTATION] = free
    return {"metadata": {"labels": labels, "annotations": annotations}}


async def publish(api: Api, node_name: str, patch: dict[str, Any]) -> None:
    """Merge-patch the Node (``api``: an ApiClient from ``core.kube.kube_client``)."""
    await call_json(api, "PATCH", NODES.path(name=node_name), body=patch, content_type=MERGE_PATCH)


class NodePublisher:
    """Keeps the Node's labels and annotation current, from its own thread."""

    def __init__(
        self, config: Config, cards: list[Card], allocator: Allocator, api: ApiLoop
    ) -> None:
        self.config = config
        self.api = api
        self.cards = cards
        self.allocator = allocator
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.published = 0

    def start(self) -> None:
        self._wake.set()
        self._thread = threading.Thread(target=self._run, name="node-publisher", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        node = self.config.node_name
        assert node is not None
        backoff = 1.0
        published_free: str | None = None
        while True:
            woken = self._wake.wait(FREE_INTERVAL_S)
            if self._stop.is_set():
                return
            self._wake.clear()
            usage = self.allocator.usage()
            free = free_annotation(usage)
            if not woken and free == published_free:
                continue
            healthy = {u.card.index: u.healthy for u in usage}
            patch = node_patch(self.cards, healthy, free)
            try:
                self.api.call(partial(publish, node_name=node, patch=patch), WRITE_TIMEOUT_S)
            except Exception as exc:  # configuration, network, 5xx, RBAC: log and retry
                log.warning(
                    "publishing the node inventory failed; retrying",
                    extra={"node": node, "error": str(exc)},
                )
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 60.0)
                self._wake.set()
                continue
            self.published += 1
            published_free = free
            backoff = 1.0


def allocatable_patch(counts: Mapping[str, int]) -> dict[str, Any]:
    return {"status": {"allocatable": {name: str(n) for name, n in sorted(counts.items())}}}


async def write_allocatable(api: Api, node_name: str, counts: Mapping[str, int]) -> None:
    """Merge-patch the Node's status: its allocatable fracgpu resources."""
    await call_json(
        api,
        "PATCH",
        NODES.path(name=node_name) + "/status",
        body=allocatable_patch(counts),
        content_type=MERGE_PATCH,
    )


class AllocatableMirror:
    """Writes the Node's allocatable GPU resources the moment the plugin's lists change.

    kube-scheduler places pods by the Node's ``status.allocatable``, which kubelet rewrites from
    the plugin's lists only at its node-status period (10 s by default). On a node with several
    cards the plugin hides free IDs that no single card could host together (``placement``), so
    for those seconds the scheduler would count capacity the plugin has withdrawn (a pod ends
    on a card that is not the open one) and place a share that kubelet then asks the plugin to
    allocate and the plugin must refuse: the pod fails with ``UnexpectedAdmissionError``, and its
    controller makes another. It would also miss capacity the plugin has just freed. The value
    kubelet will write is known here (the number of Healthy IDs of each resource), so the plugin
    writes it itself, to the status subresource, as soon as it changes; kubelet's next update
    writes the same number. Each change is written again a second later, in case kubelet's
    update raced it with the lists it had before. After a change that hid capacity, the value
    written here keeps it for ``settling.SETTLE_S`` and kubelet's lists for twice as long
    (``over_offered``): kubelet still admits what the scheduler bound by the older figure. While
    the lists keep more than the Node shows, kubelet's own status update would write their
    higher count, so the value is written again every second until they agree.

    Nothing is written while ``registered()`` is false: before kubelet has registered the
    resources, a Node offering them would draw pods that kubelet cannot admit yet.
    """

    def __init__(
        self,
        config: Config,
        allocator: Allocator,
        api: ApiLoop,
        *,
        registered: Callable[[], bool] = lambda: True,
        confirm_after_s: float = 1.0,
        retry_s: float = 1.0,
    ) -> None:
        self.config = config
        self.allocator = allocator
        self.api = api
        self.registered = registered
        self.resources = {Kind.CORE: config.core_resource, Kind.MEMORY: config.memory_resource}
        self.confirm_after_s = confirm_after_s
        self.retry_s = retry_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.published: dict[str, int] | None = None
        self.writes = 0

    def counts(self) -> dict[str, int]:
        """Healthy IDs per resource, less what kubelet's lists keep longer than the Node after a
        change that hid capacity (``settling.SETTLE_S``)."""
        return {
            name: sum(1 for device in self.allocator.devices(kind) if device.healthy)
            - self.allocator.over_offered(kind)
            for kind, name in self.resources.items()
        }

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="node-allocatable", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def withdraw(self, timeout_s: float = 2.0) -> bool:
        """Write an allocatable of 0 for both resources (the plugin is stopping); whether it
        was written.

        While no plugin serves them, kubelet refuses every pod that asks for them ("no healthy
        devices present"), but it lowers the Node's allocatable only at its next node-status
        update: a pod the scheduler places meanwhile fails on the node. Withdrawn first, the
        node draws no pod until the plugin is back and writes its lists' counts again.
        """
        node = self.config.node_name
        assert node is not None
        zero = {name: 0 for name in self.resources.values()}

        try:
            self.api.call(lambda api: write_allocatable(api, node, zero), timeout_s)
        except Exception as exc:  # stopping anyway: kubelet's update follows within its period
            log.warning(
                "withdrawing the node's allocatable GPU resources failed",
                extra={"node": node, "error": str(exc)},
            )
            return False
        self.published = zero
        log.info("node's allocatable GPU resources withdrawn while the plugin stops")
        return True

    def _run(self) -> None:
        node = self.config.node_name
        assert node is not None
        seen = -1
        confirm_at: float | None = None
        failing = False
        while not self._stop.is_set():
            wait = 1.0 if confirm_at is None else max(0.0, confirm_at - time.monotonic())
            version = self.allocator.wait_for_change(seen, wait)
            moved, seen = version != seen, version
            due = confirm_at is not None and time.monotonic() >= confirm_at
            if not self.registered():
                self._stop.wait(0.1)
                seen = -1  # once registered, write what the lists say then
                continue
            if not (moved or due or failing):
                continue  # nothing changed: no need to count the lists again
            counts = self.counts()
            if counts == self.published and not due:
                if confirm_at is None and self.allocator.keeping():
                    # kubelet writes its lists' count at its status period, and while the
                    # lists keep what a change hid, that count is higher: written again
                    # each second until the lists say what is offered.
                    confirm_at = time.monotonic() + self.confirm_after_s
                continue
            try:
                self.api.call(
                    partial(write_allocatable, node_name=node, counts=counts), WRITE_TIMEOUT_S
                )
            except Exception as exc:  # configuration, network, 5xx, RBAC: retry
                if not failing:
                    log.warning(
                        "writing the node's allocatable GPU resources failed; retrying "
                        "(kubelet still writes them every node-status period)",
                        extra={"node": node, "error": str(exc)},
                    )
                failing = True
                self._stop.wait(self.retry_s)
                continue
            if failing:
                log.info("writing the node's allocatable GPU resources works again")
            failing = False
            self.writes += 1
            changed = counts != self.published or self.allocator.keeping()
            self.published = counts
            confirm_at = time.monotonic() + self.confirm_after_s if changed else None
