"""``fracgpu node-cleanup``: what fracgpu's node agents published in the API, removed after an
uninstall.

The node agents remove their files from each node when the release is uninstalled; what they
published in the API outlives them: the device plugin's labels and annotations on its Node (the
GPU model, memory and count the webhook sizes shares by, the free capacity ``kubectl fracgpu``
reads) and, in DRA mode, the ResourceSlices of fracgpu's driver (kubelet removes those of a
plugin that went away, but only after a grace period, and not at all where the node is down).
By the time an agent stops, ``helm uninstall`` has already deleted its ServiceAccount, so it
cannot remove them itself. The chart runs this command as a post-delete hook Job, once no node
agent pod is left in the release's namespace (one still running could publish again); after
``kubectl delete -k``, run it by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Mapping
from typing import Any

from core.dra import DRIVER
from core.kube import NODES, PODS, RESOURCE_SLICES, Api, KubeNotFound, call_json, kube_client
from core.labels import (
    COUNT_LABEL,
    FREE_ANNOTATION,
    INVENTORY_ANNOTATION,
    MEMORY_LABEL,
    PRODUCT_LABEL,
)

log = logging.getLogger(__name__)

NODE_LABELS = (PRODUCT_LABEL, MEMORY_LABEL, COUNT_LABEL)
NODE_ANNOTATIONS = (INVENTORY_ANNOTATION, FREE_ANNOTATION)
# The node agents' pods, by the label both DaemonSets give them.
AGENT_SELECTOR = "app.kubernetes.io/name in (fracgpu-device-plugin,fracgpu-dra-plugin)"


def run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_run(args))
    except Exception as exc:  # the API server or the kubeconfig: say which, exit non-zero
        print(f"fracgpu node-cleanup: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


async def _run(args: argparse.Namespace) -> int:
    async with kube_client(args.kubeconfig, args.context) as api:
        if not await agents_gone(api, args.namespace, args.wait_s):
            print(
                f"fracgpu node-cleanup: node agent pods still run in namespace "
                f"{args.namespace!r} after {args.wait_s:g} s; nothing removed (run it again "
                "once they are gone)",
                file=sys.stderr,
            )
            return 1
        nodes = await clean_nodes(api)
        slices = await delete_slices(api)
    print(f"fracgpu node-cleanup: {nodes} Node(s) cleaned, {slices} ResourceSlice(s) deleted")
    return 0


async def agents_gone(api: Api, namespace: str, wait_s: float) -> bool:
    """Whether no node agent pod is left in ``namespace`` (waiting up to ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        listed = await call_json(
            api, "GET", PODS.path(namespace), query=[("labelSelector", AGENT_SELECTOR)]
        )
        if not listed.get("items"):
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(1.0)


def node_patch(node: Mapping[str, Any]) -> dict[str, Any] | None:
    """The merge patch that removes fracgpu's keys from a Node; None when it has none."""
    meta = node.get("metadata") or {}
    labels = {k: None for k in NODE_LABELS if k in (meta.get("labels") or {})}
    annotations = {k: None for k in NODE_ANNOTATIONS if k in (meta.get("annotations") or {})}
    if not labels and not annotations:
        return None
    patch: dict[str, Any] = {}
    if labels:
        patch["labels"] = labels
    if annotations:
        patch["annotations"] = annotations
    return {"metadata": patch}


async def clean_nodes(api: Api) -> int:
    cleaned = 0
    for node in (await call_json(api, "GET", NODES.path())).get("items") or []:
        patch = node_patch(node)
        if patch is None:
            continue
        name = node["metadata"]["name"]
        try:
            await call_json(
                api, "PATCH", NODES.path(name=name), body=patch,
                content_type="application/merge-patch+json",
            )  # fmt: skip
        except KubeNotFound:
            continue
        log.info("node cleaned", extra={"node": name, **patch["metadata"]})
        cleaned += 1
    return cleaned


async def delete_slices(api: Api) -> int:
    listed = await call_json(
        api, "GET", RESOURCE_SLICES.path(), query=[("fieldSelector", f"spec.driver={DRIVER}")]
    )
    deleted = 0
    for item in listed.get("items") or []:
        try:
            await call_json(api, "DELETE", RESOURCE_SLICES.path(name=item["metadata"]["name"]))
        except KubeNotFound:
            continue
        deleted += 1
    return deleted
