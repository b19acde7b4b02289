"""Publishing the node's cards on its Node object, for the webhook, schedulers and people.

Labels (selectable): ``fracgpu.io/gpu.product`` (label-safe product name; ``mixed`` when cards
differ), ``fracgpu.io/gpu.memory-mib`` (memory of the smallest card, the most a container can
count on), ``fracgpu.io/gpu.count``. Annotation ``fracgpu.io/gpu.inventory``: versioned JSON with
every card (index, uuid, product, memoryMiB, minor, numaNode, healthy).

Written with one JSON merge patch (labels and the annotation together), again whenever a card's
health changes, and retried with backoff while the API server is unreachable.

The plugin is threaded (gRPC's server runs handlers on threads), and a publish is rare (start,
health changes), so the publisher is a plain thread that runs each PATCH to completion in its own
short event loop, through the project's one client factory (``core.kube.kube_client``: the same
configuration order as every other component). No event loop outlives a publish, and each publish
reads the configuration afresh, so a rotated service-account token is picked up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from collections.abc import Iterable
from typing import Any

from core.kube import NODES, call_json, kube_client
from core.labels import (
    COUNT_LABEL,
    INVENTORY_ANNOTATION,
    INVENTORY_VERSION,
    MEMORY_LABEL,
    PRODUCT_LABEL,
)
from deviceplugin.allocator import Allocator
from deviceplugin.config import Config
from deviceplugin.inventory import Card

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"


def label_safe(text: str) -> str:
    """A label value (≤ 63 chars of [A-Za-z0-9._-], alphanumeric at both ends)."""
    value = re.sub(r"[^A-Za-z0-9._-]+", "-", text.strip())[:63]
    value = re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)
    return value or "unknown"


def node_patch(cards: Iterable[Card], healthy: dict[int, bool]) -> dict[str, Any]:
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
    return {"metadata": {"labels": labels, "annotations": annotations}}


async def publish(api: Any, node_name: str, patch: dict[str, Any]) -> None:
    """Merge-patch the Node (``api``: an ApiClient from ``core.kube.kube_client``)."""
    await call_json(api, "PATCH", NODES.path(name=node_name), body=patch, content_type=MERGE_PATCH)


class NodePublisher:
    """Keeps the Node's labels and annotation current, from its own thread."""

    def __init__(self, config: Config, cards: list[Card], allocator: Allocator) -> None:
        self.config = config
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
        while True:
            self._wake.wait()
            if self._stop.is_set():
                return
            self._wake.clear()
            healthy = {u.card.index: u.healthy for u in self.allocator.usage()}
            try:
                asyncio.run(self._publish(node, node_patch(self.cards, healthy)))
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
            backoff = 1.0

    async def _publish(self, node: str, patch: dict[str, Any]) -> None:
        async with kube_client(self.config.kubeconfig) as api:
            await publish(api, node, patch)
