"""The units a GPUQuota is written and reported in: cards and MiB.

Quotas are written the way pods are (``gpu: "4.5"``, ``gpumem: 64Gi``) but counted in the
canonical units of the cluster: hundredths of a card, and MiB (a pod's 256 MiB blocks are
converted to MiB, so a quota limit need not be a multiple of a block). Parsing goes through
:mod:`webhook.quantity`, the one place quantities are understood.
"""

from __future__ import annotations

from decimal import Decimal

from webhook.quantity import QuantityError, parse_quantity
from webhook.resources import CORE_PER_CARD, MIB

CARDS_RULE = (
    'must be a number of cards with at most two decimals, such as 4 or "4.5" '
    "(quote fractions in YAML)"
)
MEMORY_RULE = (
    "must be GPU memory as a whole number of MiB (such as 65536) or a byte quantity with a "
    "binary suffix that is a whole number of MiB (such as 64Gi)"
)
PODS_RULE = "must be a whole number of pods, 0 or more"


class UnitError(ValueError):
    """A quota value that is not in the expected unit; the message says what is expected."""


def parse_cards(raw: object) -> int:
    """Cards as written in a quota → hundredths of a card (``"4.5"`` → 450)."""
    try:
        q = parse_quantity(raw)
    except QuantityError:
        raise UnitError(CARDS_RULE) from None
    hundredths = q.value * CORE_PER_CARD
    if q.format == "binary" or q.value < 0 or hundredths != hundredths.to_integral_value():
        raise UnitError(CARDS_RULE)
    return int(hundredths)


def parse_memory_mib(raw: object) -> int:
    """GPU memory as written in a quota → MiB: a plain number is MiB, ``64Gi`` is bytes."""
    try:
        q = parse_quantity(raw)
    except QuantityError:
        raise UnitError(MEMORY_RULE) from None
    if q.format == "binary":
        mib = q.value / MIB
    elif isinstance(raw, int) or (isinstance(raw, str) and raw.strip().isdigit()):
        mib = q.value
    else:  # 64G or 1e3: decimal suffixes are neither MiB nor a binary byte count
        raise UnitError(MEMORY_RULE)
    if mib < 0 or mib != mib.to_integral_value():
        raise UnitError(MEMORY_RULE)
    return int(mib)


def parse_pods(raw: object) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
        raise UnitError(PODS_RULE)
    return raw


def cards_text(core: int) -> str:
    """Hundredths of a card with two places, as quota messages print them: 370 → ``3.70``."""
    return f"{Decimal(core) / CORE_PER_CARD:.2f}"


def cards_phrase(core: int) -> str:
    """``0.50 card``, ``1.00 card``, ``4.00 cards``: singular up to one card."""
    return f"{cards_text(core)} {'card' if core <= CORE_PER_CARD else 'cards'}"
