"""Why a GPU pod waits, in the user's units (both modes).

When no card can hold a claim, kube-scheduler says only "cannot allocate all claims": the same
words for a cluster that is full, one whose free capacity is spread over cards too thin to hold
the share, a request larger than any card, and a node that publishes no slice. This module works
out what the user needs to know instead: what the pod asks, and the largest share any one card
has free, with where it is ("largest free share on any node: 0.40 card and 12288 MiB on gpu-1 of
node-a; this pod asks 0.50 card and 8192 MiB").

In DRA mode it is arithmetic over what the API server already holds: the driver's
ResourceSlices (each card's ``cores`` and ``memory``) and the allocated ResourceClaims (what each
share consumes). In device-plugin mode kube-scheduler says "Insufficient fracgpu.io/core", in
hundredths summed over a node, and only the node's plugin knows each card's share: it writes
what each card has free in the Node annotation ``fracgpu.io/gpu.free``, read here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from core import dra
from core.labels import FREE_ANNOTATION, FREE_VERSION
from core.quantity import quantity_int
from core.units import BLOCK_MIB, CORE, CORE_PER_CARD, MEMORY, MIB, cards_phrase

NO_FIT_MESSAGE = "cannot allocate all claims"
"""What kube-scheduler's FailedScheduling event and PodScheduled condition say for a claim that
fits nowhere (observed on Kubernetes 1.36)."""
REASON = "GPUShareDoesNotFit"
INSUFFICIENT = "Insufficient fracgpu.io/"
"""What kube-scheduler's message says for a device-plugin pod that fits no node's sums."""
SCHEDULER_DOWN = "GPUSchedulerNotRunning"
"""The reason of the Event on a pod that names a scheduler that is not running: no scheduler
looks at it, so nothing else says why it waits (no event, no condition)."""


@dataclass(frozen=True, order=True, slots=True)
class FreeCard:
    """What one card has left: hundredths of the card and MiB."""

    cores: int
    memory_mib: int
    node: str
    device: str

    def phrase(self) -> str:
        return (
            f"{cards_phrase(self.cores)} and {self.memory_mib} MiB on {self.device} of {self.node}"
        )


@dataclass(frozen=True, slots=True)
class CardNeed:
    """What one device request of a claim (or one GPU container of a device-plugin pod) needs
    from a card (``cards`` > 0: whole cards), on ``count`` distinct cards of one node for a share
    of several cards. Not ``webhook.parsing.ContainerAsk``: this is read back from what
    admission wrote, to say why a pod waits."""

    cores: int = 0
    memory_mib: int = 0
    cards: int = 0
    count: int = 1

    def phrase(self) -> str:
        if self.cards:
            return f"{self.cards} whole {'card' if self.cards == 1 else 'cards'}"
        share = f"{cards_phrase(self.cores)} and {self.memory_mib} MiB"
        return share if self.count == 1 else f"{share} on each of {self.count} cards"

    def holds(self, card: FreeCard) -> bool:
        return card.cores >= self.cores and card.memory_mib >= self.memory_mib


def free_cards(
    slices: Iterable[Mapping[str, Any]], claims: Iterable[Mapping[str, Any]]
) -> list[FreeCard]:
    """Every card of the driver with what allocated claims have not consumed."""
    used: dict[tuple[str, str], tuple[int, int]] = {}
    for claim in claims:
        allocation = (claim.get("status") or {}).get("allocation") or {}
        for result in (allocation.get("devices") or {}).get("results") or []:
            if result.get("driver") != dra.DRIVER:
                continue
            consumed = result.get("consumedCapacity") or {}
            cores = quantity_int(consumed.get(dra.CORES)) or 0
            memory = quantity_int(consumed.get(dra.MEMORY)) or 0
            key = (str(result.get("pool")), str(result.get("device")))
            was = used.get(key, (0, 0))
            used[key] = (was[0] + cores, was[1] + memory)
    free: list[FreeCard] = []
    for piece in slices:
        spec = piece.get("spec") or {}
        if spec.get("driver") != dra.DRIVER:
            continue
        pool = str((spec.get("pool") or {}).get("name") or "")
        node = str(spec.get("nodeName") or pool)
        for device in spec.get("devices") or []:
            capacity = device.get("capacity") or {}
            cores = quantity_int((capacity.get(dra.CORES) or {}).get("value")) or 0
            memory = quantity_int((capacity.get(dra.MEMORY) or {}).get("value")) or 0
            taken = used.get((pool, str(device.get("name"))), (0, 0))
            free.append(
                FreeCard(
                    max(cores - taken[0], 0),
                    max(memory - taken[1], 0) // MIB // BLOCK_MIB * BLOCK_MIB,
                    node,
                    str(device.get("name")),
                )
            )
    return free


def asks_of(claim_spec: Mapping[str, Any]) -> list[CardNeed]:
    """What each device request of a claim (or template) spec needs; for ``firstAvailable``,
    the smallest alternative (the one most likely to fit)."""
    asks: list[CardNeed] = []
    for request in (claim_spec.get("devices") or {}).get("requests") or []:
        options = (
            [request["exactly"]] if "exactly" in request else request.get("firstAvailable") or []
        )
        found = [
            _ask(option) for option in options if option.get("deviceClassName") == dra.DEVICE_CLASS
        ]
        if found:
            asks.append(min(found, key=lambda a: (a.cards, a.cores, a.memory_mib)))
    return asks


def _ask(option: Mapping[str, Any]) -> CardNeed:
    wanted = (option.get("capacity") or {}).get("requests") or {}
    if not wanted:
        return CardNeed(cards=int(option.get("count") or 1))
    return CardNeed(
        cores=quantity_int(wanted.get(dra.CORES)) or CORE_PER_CARD,
        memory_mib=(quantity_int(wanted.get(dra.MEMORY)) or 0) // MIB,
        count=int(option.get("count") or 1),
    )


def explain(asks: list[CardNeed], free: list[FreeCard], *, device_plugin: bool = False) -> str:
    """The sentence a waiting pod's event carries."""
    wanted = "; ".join(ask.phrase() for ask in asks) or "a GPU"
    if not free and device_plugin:
        return (
            f"no node publishes what its cards have free (Node annotation {FREE_ANNOTATION}); "
            f"this pod asks {wanted}; check that fracgpu device-plugin runs on the GPU nodes "
            f"with --node-name"
        )
    if not free:
        return (
            f"no node publishes fracgpu GPUs (no ResourceSlice of {dra.DRIVER}); this pod asks "
            f"{wanted}; check that fracgpu dra-plugin runs on the GPU nodes"
        )
    whole = sum(1 for card in free if card.cores == CORE_PER_CARD)
    if any(ask.cards for ask in asks):
        return (
            f"whole cards free on the cluster: {whole}, at most "
            f"{max(_whole_per_node(free).values(), default=0)} on one node; this pod asks {wanted}"
        )
    several = [ask for ask in asks if ask.count > 1]
    if several:
        # The cards must be on one node: say how many of one node's cards could each hold it.
        ask = max(several, key=lambda a: a.count)
        per_node: dict[str, int] = {}
        for card in free:
            if ask.holds(card):
                per_node[card.node] = per_node.get(card.node, 0) + 1
        most = max(per_node.items(), key=lambda item: (item[1], item[0]), default=("", 0))
        where = f" (on {most[0]})" if most[1] else ""
        return (
            f"cards of one node that could each take {cards_phrase(ask.cores)} and "
            f"{ask.memory_mib} MiB: at most {most[1]}{where}; this pod asks {wanted}"
        )
    best = max(free, key=lambda card: (card.cores, card.memory_mib))
    return f"largest free share on any node: {best.phrase()}; this pod asks {wanted}"


def _whole_per_node(free: list[FreeCard]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for card in free:
        if card.cores == CORE_PER_CARD:
            counts[card.node] = counts.get(card.node, 0) + 1
    return counts


def waits_for_gpu(pod: Mapping[str, Any]) -> bool:
    """A pod the scheduler left Pending because no card could take one of its claims."""
    return _unschedulable_saying(pod, NO_FIT_MESSAGE)


def _unschedulable_saying(pod: Mapping[str, Any], words: str) -> bool:
    """A Pending pod whose PodScheduled condition is False with ``words`` in its message."""
    status = pod.get("status") or {}
    if status.get("phase") not in (None, "Pending"):
        return False
    return any(
        condition.get("type") == "PodScheduled"
        and condition.get("status") == "False"
        and words in str(condition.get("message") or "")
        for condition in status.get("conditions") or []
    )


def free_cards_of_nodes(nodes: Iterable[Mapping[str, Any]]) -> list[FreeCard]:
    """Every card of every node whose device plugin publishes what it has free (device-plugin
    mode); a node with an unreadable annotation is left out."""
    free: list[FreeCard] = []
    for node in nodes:
        meta = node.get("metadata") or {}
        raw = (meta.get("annotations") or {}).get(FREE_ANNOTATION)
        if not isinstance(raw, str):
            continue
        try:
            document = json.loads(raw)
            if document.get("version") != FREE_VERSION:
                continue
            cards = [
                FreeCard(
                    int(card["cores"]),
                    int(card["memoryMiB"]),
                    str(meta.get("name") or ""),
                    f"card {int(card['index'])}",
                )
                for card in document["cards"]
            ]
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
        free.extend(cards)
    return free


def asks_of_pod(pod: Mapping[str, Any]) -> list[CardNeed]:
    """What each GPU container of a device-plugin pod needs from a card, from the canonical
    resources the webhook wrote (``fracgpu.io/core`` in hundredths, ``fracgpu.io/memory`` in
    256 MiB blocks; whole cards carry core alone)."""
    asks: list[CardNeed] = []
    for container in (pod.get("spec") or {}).get("containers") or []:
        limits = (container.get("resources") or {}).get("limits") or {}
        core = quantity_int(limits.get(CORE)) or 0
        if core <= 0:
            continue
        memory = quantity_int(limits.get(MEMORY)) or 0
        if core % CORE_PER_CARD == 0:
            asks.append(CardNeed(cards=core // CORE_PER_CARD))
        else:
            asks.append(CardNeed(cores=core, memory_mib=memory * BLOCK_MIB))
    return asks


def waits_for_share(pod: Mapping[str, Any]) -> bool:
    """A device-plugin pod the scheduler left Pending because no node's free fracgpu capacity
    (what one card can host, by the device plugin's honesty rule) covers it."""
    return _unschedulable_saying(pod, INSUFFICIENT)


def unscheduled_by(pod: Mapping[str, Any], scheduler: str) -> bool:
    """A Pending pod left to ``scheduler`` and not bound yet: with that scheduler down, nothing
    else will write a word on it."""
    spec = pod.get("spec") or {}
    phase = (pod.get("status") or {}).get("phase")
    return (
        spec.get("schedulerName") == scheduler
        and not spec.get("nodeName")
        and phase in (None, "Pending")
    )


def scheduler_down(scheduler: str, why: str) -> str:
    """The Event's words for a GPU pod waiting on a scheduler that is not running. With extender
    placement admission hands every GPU pod to it even then (another scheduler would bind it
    with no card recorded); otherwise the pod was handed over while it ran."""
    return (
        f"scheduler {scheduler} is not running ({why}); nothing schedules this pod until it "
        f"runs again; check the Deployment that runs {scheduler}"
    )
