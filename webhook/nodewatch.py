"""Keeps the GPU inventory current from the cluster's Nodes (list + watch, relist on 410).

Kept apart from :mod:`webhook.inventory` so that ``fracgpu review`` never imports the
Kubernetes client.
"""

from __future__ import annotations

from core.informer import EventType, Informer, Informers
from core.kube import NODES, Api, RawBody
from webhook.inventory import Inventory


def node_informer(api: Api, inventory: Inventory, informers: Informers | None = None) -> Informer:
    """An informer on Nodes whose events update ``inventory``; start it, then await its sync.

    A relist replays vanished nodes as DELETED, so a node removed while the watch was down
    does not linger in the inventory.
    """

    def on_event(kind: EventType, node: RawBody) -> None:
        meta = node.get("metadata") or {}
        name = str(meta.get("name") or "")
        if kind == "DELETED":
            inventory.remove_node(name)
        else:
            inventory.set_node(name, meta.get("labels") or {})

    informer = (informers or Informers(api)).of(NODES)
    informer.add_handler(on_event)
    return informer
