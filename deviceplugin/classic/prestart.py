"""From a container's place in the ledger to its limits file (PreStartContainer's decision)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from core.contract import Limits
from core.units import BLOCK_MIB, CORE_PER_CARD, MIB
from deviceplugin.shared.inventory import Card


class PreStartError(ValueError):
    """The container's devices cannot be turned into limits."""


def limits_for(
    name: str,
    core: int,
    memory: int,
    placed: Sequence[int],
    cards: Mapping[int, Card],
    *,
    core_resource: str,
    memory_resource: str,
) -> Limits:
    """The limits of container ``name`` (namespace/pod/container) holding ``core`` core IDs and
    ``memory`` memory IDs, placed on the cards ``placed``.

    Whole cards (core in hundreds) may come without memory IDs (admission sizes them without
    knowing the model): they get all of each card's memory, as NVML reports it. A share of a
    card needs both.
    """
    whole = core // CORE_PER_CARD if core and core % CORE_PER_CARD == 0 else 0
    if not whole and (not core or not memory):
        missing = core_resource if not core else memory_resource
        raise PreStartError(
            f"container {name} holds no {missing}: a share of a card needs both "
            f"{core_resource} and {memory_resource} (only whole cards, {CORE_PER_CARD} "
            f"{core_resource} per card, may come without memory); the fracgpu admission webhook "
            f"sizes the request, so create the pod through it"
        )
    unknown = sorted(set(placed) - set(cards))
    if unknown or not placed:
        raise PreStartError(f"container {name} is placed on no known card ({list(placed)})")
    if whole:
        return Limits(
            devices=tuple(cards[i].uuid for i in sorted(placed)),
            memory_bytes=min(cards[i].memory_mib for i in placed) * MIB,
            compute_percent=CORE_PER_CARD,
        )
    return Limits(
        devices=(cards[placed[0]].uuid,),
        memory_bytes=memory * BLOCK_MIB * MIB,
        compute_percent=core,
    )
