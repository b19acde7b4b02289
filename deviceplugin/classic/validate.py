"""Which device IDs a request may hold: the ones this node lists, each once, in a size that fits.

Pure functions over the node's cards (``blocks``: card index -> memory IDs it lists). A request
that fails here can never work on this node, so Allocate refuses it for good
(``AllocationError``); a preference that names an unknown ID gets no answer instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from core.units import CORE_PER_CARD
from deviceplugin.classic.allocation import AllocationError
from deviceplugin.classic.ids import DeviceId, DeviceIdError, Kind


def known(kind: Kind, text: str, blocks: Mapping[int, int]) -> bool:
    """Whether ``text`` is an ID this plugin lists for ``kind``."""
    try:
        parsed = DeviceId.parse(text)
    except DeviceIdError:
        return False
    total = CORE_PER_CARD if kind is Kind.CORE else blocks.get(parsed.card, 0)
    return parsed.kind is kind and parsed.card in blocks and parsed.number < total


def check(kind: Kind, ids: Iterable[str], resource: str, blocks: Mapping[int, int]) -> None:
    """That every ID is one this plugin lists for ``kind``, once; AllocationError if not."""
    seen: set[str] = set()
    for text in ids:
        try:
            parsed = DeviceId.parse(text)
        except DeviceIdError as exc:
            raise AllocationError(f"{resource}: {exc}") from None
        if text in seen:
            raise AllocationError(f"{resource}: device ID {text!r} appears twice")
        seen.add(text)
        if parsed.kind is not kind:
            raise AllocationError(
                f"{resource}: device ID {text!r} belongs to the other fracgpu resource"
            )
        total = CORE_PER_CARD if kind is Kind.CORE else blocks.get(parsed.card, 0)
        if parsed.card not in blocks or parsed.number >= total:
            raise AllocationError(f"{resource}: device ID {text!r} is unknown on this node")
    if not seen:
        raise AllocationError(f"{resource}: the request holds no device IDs")
    if kind is Kind.CORE and len(seen) > CORE_PER_CARD and len(seen) % CORE_PER_CARD:
        raise AllocationError(
            f"{resource}: {len(seen)} is neither a share of one card (1-{CORE_PER_CARD - 1}) "
            f"nor whole cards (a multiple of {CORE_PER_CARD}); the fracgpu admission webhook "
            f"sizes requests, so create the pod through it"
        )
    if kind is Kind.CORE and len(seen) // CORE_PER_CARD > len(blocks):
        raise AllocationError(
            f"{resource}: {len(seen) // CORE_PER_CARD} whole cards asked for, this node has "
            f"{len(blocks)}"
        )
