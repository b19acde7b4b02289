"""Each share's live use, as the node agents measure it, for ``kubectl fracgpu top``.

The node guard exports per container and card the card memory its processes hold and the
percent of the card's SMs they kept busy (``*_share_memory_used_bytes``,
``*_share_compute_used_percent``, :mod:`deviceplugin.shared.guard`). ``top`` reads them where a
user's kubectl can: through the API server's proxy to each node agent pod's metrics port
(``pods/proxy``, which a cluster admin has and most users do not). Where it cannot, ``top``
says why once and shows the grants alone: the figures are an addition, never a condition.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from core.kube import PODS, Api, KubeError, call_json, open_request

# The node agents' pods, by the name label both deploys give them (any namespace: a Helm
# release may live in another than fracgpu).
AGENT_SELECTOR = "app.kubernetes.io/name in (fracgpu-device-plugin,fracgpu-dra-plugin)"
METRICS_PORT_NAME = "metrics"
_SERIES = re.compile(
    r"^fracgpu_(?:device_plugin|dra_plugin)_share_(memory_used_bytes|compute_used_percent)"
    r"\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)$"
)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class LiveUse:
    """What one container of a share uses on one card now."""

    namespace: str
    pod: str
    container: str
    card_uuid: str
    memory_mib: int
    busy_percent: float | None  # None: the card does not sample per process


def parse(text: str) -> list[LiveUse]:
    """The share series of one node agent's Prometheus text exposition."""
    memory: dict[tuple[str, str, str, str], float] = {}
    busy: dict[tuple[str, str, str, str], float] = {}
    for line in text.splitlines():
        match = _SERIES.match(line.strip())
        if match is None:
            continue
        labels = dict(_LABEL.findall(match["labels"]))
        key = (
            labels.get("namespace", ""),
            labels.get("pod", ""),
            labels.get("container", ""),
            labels.get("card_uuid", ""),
        )
        try:
            value = float(match["value"])
        except ValueError:
            continue
        (memory if match.group(1) == "memory_used_bytes" else busy)[key] = value
    return [
        LiveUse(*key, memory_mib=int(used) >> 20, busy_percent=busy.get(key))
        for key, used in sorted(memory.items())
    ]


def _metrics_port(pod: Mapping[str, Any]) -> int | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == METRICS_PORT_NAME and isinstance(port.get("containerPort"), int):
                return int(port["containerPort"])
    return None


async def _scrape(api: Api, pod: Mapping[str, Any]) -> list[LiveUse] | str:
    meta = pod.get("metadata") or {}
    name, namespace = str(meta.get("name")), str(meta.get("namespace"))
    port = _metrics_port(pod)
    if port is None:
        return f"node agent pod {namespace}/{name} has no port named {METRICS_PORT_NAME!r}"
    path = f"{PODS.path(namespace, f'{name}:{port}')}/proxy/metrics"
    try:
        response = await open_request(api, "GET", path, timeout_s=5.0)
        try:
            text = await response.text()
        finally:
            response.release()
    except KubeError as exc:
        if exc.status == 403:
            return (
                "live use needs pods/proxy on the node agents' pods (cluster admins have it): "
                + exc.message
            )
        return f"node agent pod {namespace}/{name}: {exc.message}"
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        return f"node agent pod {namespace}/{name}: {exc or type(exc).__name__}"
    return parse(text)


async def read(api: Api, nodes: Iterable[str] | None = None) -> tuple[list[LiveUse], list[str]]:
    """Every share's live use on ``nodes`` (None: all), and why some could not be read."""
    wanted = None if nodes is None else set(nodes)
    try:
        listed = await call_json(api, "GET", PODS.path(), query=[("labelSelector", AGENT_SELECTOR)])
    except KubeError as exc:
        return [], [f"cannot list the node agents' pods: {exc.message}"]
    agents = [
        p
        for p in listed.get("items") or []
        if (p.get("status") or {}).get("phase") == "Running"
        and (wanted is None or (p.get("spec") or {}).get("nodeName") in wanted)
    ]
    results = await asyncio.gather(*(_scrape(api, p) for p in agents))
    uses = [use for r in results if not isinstance(r, str) for use in r]
    problems = sorted({r for r in results if isinstance(r, str)})
    return uses, problems


__all__ = ["AGENT_SELECTOR", "LiveUse", "parse", "read"]
