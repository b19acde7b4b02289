"""From the devices a container holds to its limits file (PreStartContainer's decision)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from core.contract import Limits
from core.units import BLOCK_MIB, CORE_PER_CARD, MIB
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
    core_resource: str,
    memory_resource: str,
) -> Limits:
    """The limits of container ``name`` (namespace/pod/container) holding these device IDs.

    Whole cards may come without memory IDs (admission sizes them without knowing the model):
    they get all of each card's memory, as NVML reports it. A share of a card needs both.
    """
    if core and not memory:
        core_cards = _cards_of(core, Kind.CORE)
        if all(n == CORE_PER_CARD for n in core_cards.values()):
            return _whole_cards(name, core_cards, cards)
    if not core or not memory:
        missing = core_resource if not core else memory_resource
        raise PreStartError(
            f"container {name} holds no {missing}: a share of a card needs both "
            f"{core_resource} and {memory_resource} (only whole cards, {CORE_PER_CARD} "
            f"{core_resource} per card, may come without memory); the fracgpu admission webhook "
            f"sizes the request, so create the pod through it"
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
        memory_bytes=memory_blocks * BLOCK_MIB * MIB,
        compute_percent=min(compute, CORE_PER_CARD),
    )


def _whole_cards(name: str, core_cards: Counter[int], cards: Mapping[int, Card]) -> Limits:
    unknown = sorted(set(core_cards) - set(cards))
    if unknown:
        raise PreStartError(f"container {name} holds devices of unknown cards {unknown}")
    return Limits(
        devices=tuple(cards[i].uuid for i in sorted(core_cards)),
        memory_bytes=min(cards[i].memory_mib for i in core_cards) * MIB,
        compute_percent=CORE_PER_CARD,
    )
