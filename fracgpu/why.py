"""``fracgpu why POD`` (also ``kubectl fracgpu why POD``): why a GPU pod is not running, in the
user's units.

The scheduler's own words for a GPU pod that fits nowhere say little ("Insufficient
fracgpu.io/core", "cannot allocate all claims"); the answer here is the webhook's
``GPUShareDoesNotFit`` sentence, worked out afresh from what the cluster holds now (both modes:
``webhook.waiting``), plus what else holds the pod back and its recent warnings. A pod that
admission denied was never created, so there is nothing to ask about: the command says how to
see the denial again without creating anything.

Reads only: the pod, its events, and for a pod that waits for a card the Nodes (device-plugin
mode) or the driver's ResourceSlices and every ResourceClaim (DRA mode). Where RBAC forbids
those lists, the webhook's last event on the pod says the same thing, and is shown instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import aiohttp
import yaml

from core import dra
from core.kube import (
    EVENTS,
    NODES,
    PODS,
    RESOURCE_CLAIMS,
    RESOURCE_SLICES,
    Api,
    KubeConfigError,
    KubeError,
    KubeNotFound,
    call_json,
    kube_client,
)
from webhook.waiting import (
    REASON,
    CardNeed,
    FreeCard,
    asks_of,
    asks_of_pod,
    explain,
    free_cards,
    free_cards_of_nodes,
    waits_for_gpu,
    waits_for_share,
)

Obj = Mapping[str, Any]
RECENT_EVENTS = 5


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """What ``why`` found; ``state`` is one of the words in ``STATES``."""

    namespace: str
    pod: str
    phase: str
    state: str
    message: str
    mode: str = ""  # "device-plugin", "dra" or "" (no fracgpu GPU)
    node: str = ""
    asks: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)


STATES = (
    "no-gpu",  # the pod asks no fracgpu GPU
    "running",
    "ended",
    "waiting-for-a-card",  # no card can host its share now: the scheduler leaves it Pending
    "unschedulable",  # the scheduler leaves it Pending for another reason
    "scheduling",  # not decided by the scheduler yet
    "starting",  # on a node, its containers not running yet
)


@dataclass(slots=True)
class Cluster:
    """What the diagnosis reads besides the pod (None: not read, or not allowed to)."""

    claims: list[Obj] | None = None  # the pod's own claims (DRA)
    every_claim: list[Obj] | None = None
    slices: list[Obj] | None = None
    nodes: list[Obj] | None = None
    events: list[Obj] = field(default_factory=list)


def pod_claim_names(pod: Obj) -> list[str]:
    """The ResourceClaims the pod's claims resolved to (templates' claims included)."""
    return [
        str(entry.get("resourceClaimName"))
        for entry in (pod.get("status") or {}).get("resourceClaimStatuses") or []
        if entry.get("resourceClaimName")
    ]


def _ours(claim: Obj) -> bool:
    requests = ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []
    for request in requests:
        options = [request["exactly"]] if "exactly" in request else request.get("firstAvailable")
        if any(o.get("deviceClassName") == dra.DEVICE_CLASS for o in options or []):
            return True
    return False


def _event_line(event: Obj) -> str:
    count = int(event.get("count") or (event.get("series") or {}).get("count") or 1)
    times = f" (x{count})" if count > 1 else ""
    kind, reason = event.get("type", "Normal"), event.get("reason", "")
    return f"{kind} {reason}{times}: {event.get('message', '')}"


def _condition(pod: Obj, kind: str) -> Obj | None:
    conditions: list[Obj] = (pod.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == kind), None)


def _waiting_containers(pod: Obj) -> list[str]:
    status = pod.get("status") or {}
    found = []
    for entry in [
        *(status.get("initContainerStatuses") or []),
        *(status.get("containerStatuses") or []),
    ]:
        waiting = (entry.get("state") or {}).get("waiting") or {}
        if waiting:
            reason = waiting.get("reason") or "Waiting"
            detail = f": {waiting['message']}" if waiting.get("message") else ""
            found.append(f"container {entry.get('name')}: {reason}{detail}")
    return found


def diagnose(pod: Obj, cluster: Cluster) -> Diagnosis:
    """Why ``pod`` is where it is, from ``cluster`` (pure: the tests give it objects)."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    namespace, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
    phase = str(status.get("phase") or "Pending")
    node = str(spec.get("nodeName") or "")
    asks: list[CardNeed] = asks_of_pod(pod)
    mode = "device-plugin" if asks else ""
    if not asks and cluster.claims:
        for claim in cluster.claims:
            asks.extend(asks_of(claim.get("spec") or {}) if _ours(claim) else [])
        mode = "dra" if asks else ""
    if not mode and any(
        str(c.get("resourceClaimTemplateName") or "").startswith(dra.TEMPLATE_PREFIX)
        for c in spec.get("resourceClaims") or []
    ):
        mode = "dra"  # the webhook's claim templates; their claims are not made (or read) yet
    warnings = [e for e in cluster.events if e.get("type") == "Warning"][-RECENT_EVENTS:]
    base = Diagnosis(
        namespace=namespace,
        pod=name,
        phase=phase,
        state="",
        message="",
        mode=mode,
        node=node,
        asks=[a.phrase() for a in asks],
        events=[_event_line(e) for e in warnings],
    )
    if not mode:
        return replace(
            base,
            state="no-gpu",
            message="it asks no fracgpu GPU (no fracgpu.io/core limit, no claim of the "
            f"{dra.DEVICE_CLASS} DeviceClass)",
        )
    if phase == "Running":
        return replace(base, state="running", message=f"it runs on node {node}")
    if phase in ("Succeeded", "Failed"):
        why = status.get("reason") or status.get("message") or phase
        return replace(base, state="ended", message=f"it ended: {why}")
    if (mode == "device-plugin" and waits_for_share(pod)) or (mode == "dra" and waits_for_gpu(pod)):
        return replace(base, state="waiting-for-a-card", message=_no_card(mode, asks, cluster))
    scheduled = _condition(pod, "PodScheduled")
    if not node and scheduled is not None and scheduled.get("status") == "False":
        said = scheduled.get("message") or scheduled.get("reason") or "no reason given"
        return replace(base, state="unschedulable", message=f"the scheduler says: {said}")
    if not node:
        scheduler = spec.get("schedulerName") or "default-scheduler"
        return replace(
            base,
            state="scheduling",
            message=f"no scheduler has placed it yet (schedulerName {scheduler})",
        )
    held = _waiting_containers(pod)
    detail = "; ".join(held) if held else "its containers are being created"
    return replace(base, state="starting", message=f"placed on node {node}; {detail}")


def _no_card(mode: str, asks: list[CardNeed], cluster: Cluster) -> str:
    free: list[FreeCard] | None = None
    if mode == "device-plugin" and cluster.nodes is not None:
        free = free_cards_of_nodes(cluster.nodes)
    elif mode == "dra" and cluster.slices is not None and cluster.every_claim is not None:
        free = free_cards(cluster.slices, cluster.every_claim)
    if free is not None:
        return (
            f"no card can host it now: {explain(asks, free, device_plugin=mode == 'device-plugin')}"
        )
    told = [e for e in cluster.events if e.get("reason") == REASON]
    if told:
        return f"no card can host it now: {told[-1].get('message')} (the webhook's last event)"
    what = "Nodes" if mode == "device-plugin" else "ResourceSlices and ResourceClaims"
    return (
        "no card can host it now; what each card has free is not readable with these "
        f"credentials (listing {what} is forbidden) and the webhook has posted no "
        f"{REASON} event on the pod yet"
    )


async def _list(api: Api, path: str) -> list[Obj] | None:
    """The items at ``path``, or None where RBAC forbids the list."""
    try:
        answer = await call_json(api, "GET", path)
    except KubeError as exc:
        if exc.status in (401, 403):
            return None
        raise
    return list(answer.get("items") or [])


async def gather(api: Api, namespace: str, name: str) -> tuple[Obj, Cluster]:
    """Read the pod and what its diagnosis needs (raises KubeNotFound for no such pod)."""
    pod = await call_json(api, "GET", PODS.path(namespace, name))
    cluster = Cluster()
    uid = (pod.get("metadata") or {}).get("uid")
    selector = f"involvedObject.uid={uid}" if uid else f"involvedObject.name={name}"
    events = await _list(api, f"{EVENTS.path(namespace)}?fieldSelector={selector}") or []
    cluster.events = sorted(
        events, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or "")
    )
    claims: list[Obj] = []
    for claim_name in pod_claim_names(pod):
        try:
            claims.append(await call_json(api, "GET", RESOURCE_CLAIMS.path(namespace, claim_name)))
        except KubeNotFound:
            continue
    cluster.claims = claims
    if asks_of_pod(pod):
        if waits_for_share(pod):
            cluster.nodes = await _list(api, NODES.path())
    elif claims and waits_for_gpu(pod):
        cluster.slices = await _list(api, RESOURCE_SLICES.path())
        cluster.every_claim = await _list(api, RESOURCE_CLAIMS.path())
    return pod, cluster


def render(diagnosis: Diagnosis) -> str:
    lines = [
        f"pod {diagnosis.namespace}/{diagnosis.pod}: {diagnosis.phase}, {diagnosis.state}",
        f"  {diagnosis.message}",
    ]
    if diagnosis.asks:
        lines.append(f"  asks: {'; '.join(diagnosis.asks)} ({diagnosis.mode} mode)")
    if diagnosis.events:
        lines.append("  recent warnings:")
        lines.extend(f"    {line}" for line in diagnosis.events)
    return "\n".join(lines) + "\n"


async def _why(args: argparse.Namespace) -> int:
    namespace = args.namespace or "default"
    try:
        async with kube_client(args.kubeconfig, args.context) as api:
            pod, cluster = await gather(api, namespace, args.pod)
    except KubeNotFound:
        sys.stderr.write(
            f"fracgpu why: pod {namespace}/{args.pod} does not exist. A pod that admission "
            "denied was never created; its reason was printed by the command that created it. "
            "To see it again without creating anything: kubectl create --dry-run=server -f "
            "FILE, or offline: fracgpu review FILE\n"
        )
        return 1
    except (KubeConfigError, KubeError, aiohttp.ClientError, OSError) as exc:
        sys.stderr.write(f"fracgpu why: cannot ask the API server: {exc}\n")
        return 2
    diagnosis = diagnose(pod, cluster)
    if args.output == "json":
        sys.stdout.write(json.dumps(asdict(diagnosis), indent=2) + "\n")
    elif args.output == "yaml":
        sys.stdout.write(yaml.safe_dump(asdict(diagnosis), sort_keys=False))
    else:
        sys.stdout.write(render(diagnosis))
    return 0


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_why(args))


__all__ = ["STATES", "Cluster", "Diagnosis", "diagnose", "gather", "render", "run"]
