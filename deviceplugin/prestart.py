"""From the devices a container holds to its limits file (PreStartContainer's decision)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from core.contract import Limits
from core.units import CORE_PER_CARD, MIB
from deviceplugin.ids import DeviceId, DeviceIdError, Kind
from deviceplugin.inventory import Card


class PreStartError(ValueError):
    """The container's devices cannot be turned into limits."""


def _cards_of(ids: frozenset[str], kind: Kind) -> Counter[int]:
    counts: Counter[int] = Counter()
    for text in ids:
        try:
            parsed = DeviceId.parse(text)
        except DeviceIdError as exc:
            raise PreStartError(str(exc)) from None
        if parsed.kind is not kind:
            raise PreStartError(f"device ID {text!r} is listed under the wrong resource")
        counts[parsed.card] += 1
    return counts


def limits_for(
    name: str,
    core: frozenset[str],
    memory: frozenset[str],
    cards: Mapping[int, Card],
    *,
    block_mib: int,
    core_resource: str,
    memory_resource: str,
) -> Limits:
    """The limits of container ``name`` (namespace/pod/container) holding these device IDs."""
    if not core or not memory:
        missing = core_resource if not core else memory_resource
        raise PreStartError(
            f"container {name} holds no {missing}: fracgpu needs both {core_resource} and "
            f"{memory_resource}; the fracgpu admission webhook adds them, so create the pod "
            f"through it (or request both)"
        )
    core_cards = _cards_of(core, Kind.CORE)
    memory_cards = _cards_of(memory, Kind.MEMORY)
    if set(core_cards) != set(memory_cards):
        raise PreStartError(
            f"container {name} holds core on cards {sorted(core_cards)} but memory on cards "
            f"{sorted(memory_cards)}; both must be on the same card(s): delete the pod"
        )
    unknown = sorted(set(core_cards) - set(cards))
    if unknown:
        raise PreStartError(f"container {name} holds devices of unknown cards {unknown}")
    if len(core_cards) > 1 and any(n != CORE_PER_CARD for n in core_cards.values()):
        raise PreStartError(
            f"container {name} holds a share of a card spread over cards {dict(core_cards)}"
        )
    compute = min(core_cards.values())
    memory_blocks = min(memory_cards.values())
    return Limits(
        devices=tuple(cards[i].uuid for i in sorted(core_cards)),
        memory_bytes=memory_blocks * block_mib * MIB,
        compute_percent=min(compute, CORE_PER_CARD),
    )
