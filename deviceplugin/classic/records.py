"""Extender placement: a container's card(s), read from its pod's placement record.

The scheduler extender records each container's card on the pod, through the Binding, in the
same update that binds it (``core.placement``, ``fracgpu.io/placement``). kubelet never names the
pod to a device plugin; the plugin learns it where that is exact, from PodResources ``List`` once
kubelet has recorded the container's devices (early verification or PreStartContainer), by the
device IDs it holds: namespace, pod and container names. It then reads the pod from the API
server (``GET``, on the agent's one API thread, as ``policies`` reads a pod's compute policy) and
directs the container to the record's cards (``directed``).

What a container's pod can say, and what follows:

- a record for this node naming this container, with the amounts it holds: its cards (mapped
  from UUIDs to this node's indices); placed there once this plugin's own ledger has room there,
  it waits (``UNAVAILABLE``) until then, never refused;
- no record (created before the switch, or bound by another scheduler): ``()``, the node's own
  best fit, with the same waiting;
- a record for another node, one that does not name this container, that names a card this node
  does not have, that disagrees with what kubelet allocated, or that cannot be read:
  :class:`RecordError` (``FAILED_PRECONDITION``, which kubelet retries too), whose message
  says which;
- the pod not found, or bound to another node under that name (the container's pod was deleted,
  and kubelet is about to stop it), or the API server not answering: :class:`RecordUnavailable`
  (``UNAVAILABLE``: kubelet retries).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from core import placement as record
from core.kube import PODS, Api, KubeError, KubeNotFound, call_json
from core.units import BLOCK_MIB, CORE_PER_CARD, cards_phrase
from deviceplugin.classic.allocation import Allocation
from deviceplugin.classic.directed import DirectedAllocator
from deviceplugin.classic.ledger import CardUsage
from deviceplugin.classic.prestart import PreStartError
from deviceplugin.shared.apiloop import ApiCall
from deviceplugin.shared.inventory import Card
from deviceplugin.shared.podresources import ContainerDevices

log = logging.getLogger(__name__)

T = TypeVar("T")
PodReader = Callable[[str, str], Mapping[str, Any] | None]
"""``(namespace, name)`` -> the pod as the API server has it, None when it has none; raises
:class:`RecordUnavailable` when it cannot say."""


class RecordError(PreStartError):
    """The pod's placement record cannot place this container here; the message says why."""


class RecordUnavailable(RuntimeError):
    """The container's pod cannot be read now (transient: kubelet retries PreStartContainer)."""


def api_reader(call: Callable[[ApiCall[Any], float], Any], timeout_s: float) -> PodReader:
    """A :data:`PodReader` over the agent's API thread (``ApiLoop.call``)."""

    def read(namespace: str, name: str) -> Mapping[str, Any] | None:
        try:
            pod: Mapping[str, Any] | None = call(
                lambda api: _get_pod(api, namespace, name, timeout_s), timeout_s
            )
        except (KubeError, OSError, TimeoutError, RuntimeError) as exc:
            raise RecordUnavailable(
                f"pod {namespace}/{name}: cannot be read from the API server for its placement "
                f"record ({exc or type(exc).__name__}); kubelet retries"
            ) from None
        return pod

    return read


async def _get_pod(api: Api, namespace: str, name: str, timeout_s: float) -> dict[str, Any] | None:
    try:
        pod: dict[str, Any] = await call_json(
            api, "GET", PODS.path(namespace, name), timeout_s=timeout_s
        )
    except KubeNotFound:
        return None
    return pod


def target_cards(
    pod: Mapping[str, Any] | None,
    container: ContainerDevices,
    *,
    node: str,
    cards: Mapping[int, Card],
    core: int,
    memory: int,
) -> tuple[int, ...]:
    """The cards (indices) its pod's record directs ``container`` to, holding ``core`` core IDs
    and ``memory`` memory IDs; ``()`` when the pod has no record (best fit)."""
    who = f"{container.namespace}/{container.pod}"
    if pod is None:
        raise RecordUnavailable(
            f"pod {who}: not found in the API server (deleted; kubelet stops its containers); "
            f"its placement record cannot be read"
        )
    bound = (pod.get("spec") or {}).get("nodeName")
    if bound != node:
        raise RecordUnavailable(
            f"pod {who}: the API server's pod of that name is bound to node {bound!r}, not to "
            f"this node {node!r} (the pod kubelet starts here was deleted and its name reused)"
        )
    try:
        found = record.read((pod.get("metadata") or {}).get("annotations"), pod=who)
    except record.PlacementError as exc:
        raise RecordError(str(exc)) from None
    if found is None:
        return ()
    key = record.PLACEMENT_ANNOTATION
    if found.node != node:
        raise RecordError(
            f"pod {who}: its placement record ({key}) is for node {found.node!r}, not this node "
            f"{node!r}: the card was booked on that node, so none is placed here; the record is "
            f"written only with the pod's binding, so delete the pod to have it scheduled again"
        )
    placed = found.containers.get(container.container)
    if placed is None:
        raise RecordError(
            f"pod {who}: its placement record ({key}) places no container "
            f"{container.container!r} (it places {sorted(found.containers)}); delete the pod "
            f"to have it scheduled again"
        )
    if placed.core != core or (not placed.whole and placed.memory_blocks != memory):
        raise RecordError(
            f"pod {who} container {container.container}: its placement record ({key}) books "
            f"{placed.core} core and {placed.memory_blocks} memory blocks, but kubelet "
            f"allocated it {core} and {memory}"
        )
    by_uuid = {card.uuid: index for index, card in cards.items()}
    missing = [uuid for uuid in placed.cards if uuid not in by_uuid]
    if missing:
        raise RecordError(
            f"pod {who} container {container.container}: its placement record ({key}) names "
            f"card(s) {missing} that this node does not have (its cards: "
            f"{sorted(by_uuid)}); delete the pod to have it scheduled again"
        )
    return tuple(sorted(by_uuid[uuid] for uuid in placed.cards))


class RecordPlacement:
    """Directs containers to the cards of their pods' records (see the module docstring)."""

    def __init__(
        self,
        allocator: DirectedAllocator,
        read_pod: PodReader,
        *,
        node: str,
        cards: Mapping[int, Card],
    ) -> None:
        self._allocator = allocator
        self._read_pod = read_pod
        self.node = node
        self.cards = cards

    def direct(self, container: ContainerDevices, allocation: Allocation) -> None:
        """Read the record of ``container`` (PodResources lists it holding ``allocation``'s
        IDs) and place it on its cards if they have room; once per container (a container that
        waits is placed by the allocator as soon as they have). Raises RecordError and
        RecordUnavailable."""
        if allocation.cards or allocation.directed is not None or not allocation.placeable:
            return
        pod = self._read_pod(container.namespace, container.pod)
        target = target_cards(
            pod,
            container,
            node=self.node,
            cards=self.cards,
            core=len(allocation.core),
            memory=len(allocation.memory),
        )
        if not target:
            log.info("pod has no placement record; placed by the node's best fit",
                     extra={"container": container.name})  # fmt: skip
        self._allocator.direct(allocation, target)

    def why_waiting(self, allocation: Allocation, usage: Iterable[CardUsage]) -> str | None:
        """Why a container directed to its record's cards waits, in the user's units; None
        when it is not directed to any (the node's own reason then applies)."""
        if not allocation.directed:
            return None
        on = {u.card.index: u for u in usage}
        state = [on[i] for i in allocation.directed if i in on]
        if allocation.whole_cards:
            ask = f"{allocation.whole_cards} entirely free card(s)"
            have = ", ".join(
                f"card {u.card.index} {'in use' if u.core_used or u.memory_used else 'free'}"
                f"{'' if u.healthy else ' (failed)'}"
                for u in state
            )
        else:
            ask = (
                f"{cards_phrase(len(allocation.core))} and {len(allocation.memory) * BLOCK_MIB} MiB"
            )
            have = ", ".join(
                f"card {u.card.index} ({u.card.uuid}) has "
                f"{cards_phrase(CORE_PER_CARD - u.core_used)} and "
                f"{(u.blocks - u.memory_used) * BLOCK_MIB} MiB free"
                f"{'' if u.healthy else ' but has failed'}"
                for u in state
            )
        return (
            f"its placement record puts it on {ask} there, but {have}: a container this node "
            f"still counts there has not ended yet (a pod deleted with --force, or one still "
            f"stopping), or the card failed. It starts as soon as the card has room (kubelet "
            f"retries every 10-15 s)"
        )


__all__ = [
    "PodReader",
    "RecordError",
    "RecordPlacement",
    "RecordUnavailable",
    "api_reader",
    "target_cards",
]
