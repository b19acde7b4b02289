"""What every fracgpu card of the cluster holds and has free, read from the API server (both
modes), for ``kubectl fracgpu top`` and ``kubectl fracgpu fit``.

DRA mode is exact from API objects: the driver's ResourceSlices give each card and its
capacity (a taint marks it unhealthy), and each allocated ResourceClaim says which card each
share consumes how much of, and which pods use it (``status.reservedFor``). Device-plugin mode
knows less from outside the node: the node agent's Node annotations give each card and what it
has free (``fracgpu.io/gpu.inventory``, ``fracgpu.io/gpu.free``), and the pods bound to the node
give the shares with their grants, but which card holds which share only the node agent knows:
those shares are listed per node, not per card.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from core import dra
from core.kube import NODES, PODS, RESOURCE_CLAIMS, RESOURCE_SLICES, Api, KubeError, call_json
from core.labels import FREE_ANNOTATION, FREE_VERSION, INVENTORY_ANNOTATION, INVENTORY_VERSION
from core.quantity import quantity_int
from core.units import BLOCK_MIB, CORE, CORE_PER_CARD, MEMORY, MIB
from fracgpu.usage import LiveUse

Obj = Mapping[str, Any]
DEVICE_PLUGIN, DRA = "device-plugin", "dra"


@dataclass(frozen=True, slots=True)
class Share:
    """One pod's share: hundredths of a card and MiB (``cards``: whole cards, else 0)."""

    namespace: str
    pod: str
    containers: tuple[str, ...]
    cores: int
    memory_mib: int
    cards: int = 0
    # What the share's processes use now on this card (all cards, where it is not placed on
    # one), as its node agent measures them (:mod:`fracgpu.usage`); None: not known.
    used_mib: int | None = None
    busy_percent: float | None = None


@dataclass(slots=True)
class CardView:
    node: str
    device: str  # "gpu-0" (DRA) or "card 0" (device plugin)
    product: str
    memory_mib: int  # the card's, as its node agent offers it
    free_cores: int
    free_mib: int
    healthy: bool = True
    shares: list[Share] = field(default_factory=list)
    uuid: str = ""


@dataclass(slots=True)
class ClusterCards:
    mode: str  # "dra", "device-plugin", or "" (no fracgpu node agent publishes cards)
    cards: list[CardView] = field(default_factory=list)
    # Device-plugin mode: each node's shares, whose card only the node agent knows.
    unplaced: dict[str, list[Share]] = field(default_factory=dict)


def _whole(raw: object) -> int:
    return quantity_int(raw) or 0


def _pod_containers(pod: Obj, claim: str | None = None) -> tuple[str, ...]:
    """The pod's containers that use fracgpu (``claim``: the pod claim name they reference)."""
    found = []
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        if claim is None:
            if _whole((resources.get("limits") or {}).get(CORE)) > 0:
                found.append(str(container.get("name")))
        elif any(c.get("name") == claim for c in resources.get("claims") or []):
            found.append(str(container.get("name")))
    return tuple(found)


def dra_cards(slices: Iterable[Obj], claims: Iterable[Obj], pods: Iterable[Obj]) -> list[CardView]:
    by_uid = {str((p.get("metadata") or {}).get("uid")): p for p in pods}
    cards: dict[tuple[str, str], CardView] = {}
    for piece in slices:
        spec = piece.get("spec") or {}
        if spec.get("driver") != dra.DRIVER:
            continue
        pool = str((spec.get("pool") or {}).get("name") or "")
        for device in spec.get("devices") or []:
            capacity = device.get("capacity") or {}
            attributes = device.get("attributes") or {}
            memory = _whole((capacity.get(dra.MEMORY) or {}).get("value")) // MIB
            cards[(pool, str(device.get("name")))] = CardView(
                node=str(spec.get("nodeName") or pool),
                device=str(device.get("name")),
                product=str((attributes.get(dra.PRODUCT_ATTRIBUTE) or {}).get("string") or ""),
                memory_mib=memory,
                free_cores=_whole((capacity.get(dra.CORES) or {}).get("value")),
                free_mib=memory,
                healthy=not device.get("taints"),
                uuid=str((attributes.get(dra.UUID_ATTRIBUTE) or {}).get("string") or ""),
            )
    for claim in claims:
        status = claim.get("status") or {}
        meta = claim.get("metadata") or {}
        users = [by_uid.get(str(r.get("uid"))) for r in status.get("reservedFor") or []]
        for result in ((status.get("allocation") or {}).get("devices") or {}).get("results") or []:
            card = cards.get((str(result.get("pool")), str(result.get("device"))))
            if result.get("driver") != dra.DRIVER or card is None:
                continue
            consumed = result.get("consumedCapacity") or {}
            cores, memory = _whole(consumed.get(dra.CORES)), _whole(consumed.get(dra.MEMORY))
            if not consumed:  # a whole card: all of it
                cores, memory = CORE_PER_CARD, card.memory_mib * MIB
            card.free_cores = max(card.free_cores - cores, 0)
            card.free_mib = max(card.free_mib - memory // MIB, 0)
            found: list[Obj | None] = [u for u in users if u is not None]
            for pod in found or [None]:
                pod_meta = (pod or {}).get("metadata") or {}
                card.shares.append(
                    Share(
                        namespace=str(meta.get("namespace") or ""),
                        pod=str(pod_meta.get("name") or f"(claim {meta.get('name')})"),
                        containers=_claim_users(pod, str(meta.get("name") or "")),
                        cores=cores,
                        memory_mib=memory // MIB,
                        cards=1 if not consumed else 0,
                    )
                )
    return sorted(cards.values(), key=lambda c: (c.node, c.device))


def _claim_users(pod: Obj | None, claim_name: str) -> tuple[str, ...]:
    """The pod's containers that use the claim (by the pod claim that resolved to it)."""
    if pod is None:
        return ()
    for entry in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
        if entry.get("resourceClaimName") == claim_name:
            return _pod_containers(pod, str(entry.get("name")))
    for entry in (pod.get("spec") or {}).get("resourceClaims") or []:
        if entry.get("resourceClaimName") == claim_name:
            return _pod_containers(pod, str(entry.get("name")))
    return ()


def _annotation(node: Obj, key: str, version: int) -> list[Obj]:
    raw = ((node.get("metadata") or {}).get("annotations") or {}).get(key)
    try:
        document = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        return []
    if not isinstance(document, dict) or document.get("version") != version:
        return []
    cards = document.get("cards")
    return [c for c in cards if isinstance(c, dict)] if isinstance(cards, list) else []


def device_plugin_cards(
    nodes: Iterable[Obj], pods: Iterable[Obj]
) -> tuple[list[CardView], dict[str, list[Share]]]:
    cards: list[CardView] = []
    for node in nodes:
        name = str((node.get("metadata") or {}).get("name") or "")
        free = {
            int(c.get("index", -1)): c for c in _annotation(node, FREE_ANNOTATION, FREE_VERSION)
        }
        for card in _annotation(node, INVENTORY_ANNOTATION, INVENTORY_VERSION):
            index = int(card.get("index", -1))
            left = free.get(index, {})
            memory = int(card.get("memoryMiB") or 0) // BLOCK_MIB * BLOCK_MIB
            cards.append(
                CardView(
                    node=name,
                    device=f"card {index}",
                    product=str(card.get("product") or ""),
                    memory_mib=memory,
                    free_cores=int(left.get("cores", 0)),
                    free_mib=int(left.get("memoryMiB", 0)),
                    healthy=bool(card.get("healthy", True)),
                    uuid=str(card.get("uuid") or ""),
                )
            )
    unplaced: dict[str, list[Share]] = {}
    for pod in pods:
        spec, meta = pod.get("spec") or {}, pod.get("metadata") or {}
        if not spec.get("nodeName") or (pod.get("status") or {}).get("phase") in (
            "Succeeded",
            "Failed",
        ):
            continue
        cores = memory = 0
        for container in spec.get("containers") or []:
            limits = (container.get("resources") or {}).get("limits") or {}
            cores += _whole(limits.get(CORE))
            memory += _whole(limits.get(MEMORY)) * BLOCK_MIB
        if cores <= 0:
            continue
        whole = cores // CORE_PER_CARD if cores % CORE_PER_CARD == 0 else 0
        unplaced.setdefault(str(spec["nodeName"]), []).append(
            Share(
                namespace=str(meta.get("namespace") or ""),
                pod=str(meta.get("name") or ""),
                containers=_pod_containers(pod),
                cores=cores,
                memory_mib=memory,
                cards=whole,
            )
        )
    return sorted(cards, key=lambda c: (c.node, c.device)), unplaced


def _measured(uses: list[LiveUse]) -> tuple[int, float | None]:
    busy = [u.busy_percent for u in uses if u.busy_percent is not None]
    return sum(u.memory_mib for u in uses), (min(100.0, sum(busy)) if busy else None)


def apply_live(view: ClusterCards, uses: Iterable[LiveUse]) -> ClusterCards:
    """The view with each share's live use. In device-plugin mode the node agent's figures
    also say which card holds a share (its series name the card): a share that has processes
    on its cards is shown on them, one card's part on each; the others stay per node."""
    by_share: dict[tuple[str, str], list[LiveUse]] = {}
    for use in uses:
        by_share.setdefault((use.namespace, use.pod), []).append(use)
    for card in view.cards:
        placed = []
        for share in card.shares:
            mine = by_share.get((share.namespace, share.pod), [])
            here = [u for u in mine if u.card_uuid == card.uuid]
            used, busy = _measured(here)
            placed.append(replace(share, used_mib=used, busy_percent=busy) if here else share)
        card.shares = placed
    by_uuid = {card.uuid: card for card in view.cards if card.uuid}
    unplaced: dict[str, list[Share]] = {}
    for node, shares in view.unplaced.items():
        for share in shares:
            measured = [
                u
                for u in by_share.get((share.namespace, share.pod), ())
                if u.card_uuid in by_uuid and by_uuid[u.card_uuid].node == node
            ]
            holding = sorted({u.card_uuid for u in measured})
            if not holding:
                unplaced.setdefault(node, []).append(share)
                continue
            for uuid in holding:
                card = by_uuid[uuid]
                used, busy = _measured([u for u in measured if u.card_uuid == uuid])
                part = (
                    replace(share, cores=CORE_PER_CARD, memory_mib=card.memory_mib, cards=1)
                    if share.cards
                    else share
                )
                card.shares.append(replace(part, used_mib=used, busy_percent=busy))
    view.unplaced = unplaced
    return view


async def _items(api: Api, path: str) -> list[Obj]:
    try:
        return list((await call_json(api, "GET", path)).get("items") or [])
    except KubeError as exc:
        if exc.status == 404:  # resource.k8s.io not served: no DRA
            return []
        raise


async def read(api: Api) -> ClusterCards:
    """Every fracgpu card of the cluster, in whichever mode its node agent publishes it."""
    slices = [
        s
        for s in await _items(api, RESOURCE_SLICES.path())
        if (s.get("spec") or {}).get("driver") == dra.DRIVER
    ]
    pods = await _items(api, PODS.path())
    if slices:
        claims = await _items(api, RESOURCE_CLAIMS.path())
        return ClusterCards(DRA, dra_cards(slices, claims, pods))
    cards, unplaced = device_plugin_cards(await _items(api, NODES.path()), pods)
    return ClusterCards(DEVICE_PLUGIN if cards else "", cards, unplaced)


__all__ = [
    "DEVICE_PLUGIN",
    "DRA",
    "CardView",
    "ClusterCards",
    "Share",
    "apply_live",
    "device_plugin_cards",
    "dra_cards",
    "read",
]
