"""The canonical units every component counts in, and the one parser for cards and for MiB.

A share is counted in hundredths of a card (``fracgpu.io/core``) and in 256 MiB blocks of GPU
memory (``fracgpu.io/memory``). The webhook writes them, the device plugin advertises them, the
quota adds them up and the hook enforces what they mean; this module is their single definition.

Cards and MiB are written by users in two places, a pod's ``resources.limits`` and a GPUQuota's
``spec``. Both are parsed here, by :func:`parse_cards` and :func:`parse_mib`, so the two places
accept the same spellings and differ only where the reason below says they must:

=====================  ==========================  ===================================
written as             in a pod                    in a GPUQuota
=====================  ==========================  ===================================
``8192``               8192 MiB                    8192 MiB
``8Gi``                8192 MiB (bytes)            8192 MiB (bytes)
``8k``, ``8e3``        8000 MiB                    rejected: say ``8000`` or ``8Gi``
``0.3`` cards          a share of one card         0.30 card of a namespace's total
``2.5`` cards          rejected: a share is ≤ 1    2.50 cards
=====================  ==========================  ===================================

Why a pod accepts ``8k`` and a GPUQuota does not: the API server re-serialises every quantity in
a pod before a webhook sees it (``8000`` arrives as ``8k``, ``0.3`` as ``300m``), so admission
cannot know whether the user typed a decimal suffix, and must read it as the number it is. A
GPUQuota's fields are plain strings that reach fracgpu as typed, so a decimal suffix on memory
(where ``8G`` is neither MiB nor a binary byte count) can be refused as the likely mistake it is.
Why a pod's fraction stops at one card: a container gets a share of one card or whole cards; a
namespace's quota is a sum over many containers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Literal

from core.quantity import QuantityError, parse_quantity

DOMAIN = "fracgpu.io"
"""The API group of the GPUQuota CRD, and the prefix of every resource, label and annotation."""

# The request language users write (design §1).
GPU = f"{DOMAIN}/gpu"
GPUMEM = f"{DOMAIN}/gpumem"
GPUMEM_PERCENTAGE = f"{DOMAIN}/gpumem-percentage"
# On how many cards the share in GPU (and its memory) is given: a share of several cards, which
# only DRA mode can grant (one claim request with ``count`` and capacity per card).
GPU_COUNT = f"{DOMAIN}/gpu-count"
# The canonical form the cluster accounts (design §2).
CORE = f"{DOMAIN}/core"
MEMORY = f"{DOMAIN}/memory"
CANONICAL = (CORE, MEMORY)

CORE_PER_CARD = 100
BLOCK_MIB = 256
MIB = 2**20

# Annotation that records what the user asked, before it was rewritten.
REQUEST_ANNOTATION = f"{DOMAIN}/request"
# Environment variables that describe the grant to the application (design §3).
ENV_GPU = "FRACGPU_GPU"
ENV_MEMORY_MIB = "FRACGPU_MEMORY_MIB"
ENV_GPU_COUNT = "FRACGPU_GPU_COUNT"
"""The number of cards a container holds (DRA mode); FRACGPU_GPU is then the share of each."""
SYSTEM_ENV_PREFIX = "FRACGPU_"
"""Variables with this prefix are set by fracgpu alone; pods may not set them."""

Source = Literal["pod", "quota"]

POD_CARDS_RULE = (
    "must be a fraction between 0.01 and 1 with at most two decimals, or a whole number of cards"
)
QUOTA_CARDS_RULE = (
    'must be a number of cards with at most two decimals, such as 4 or "4.5" '
    "(quote fractions in YAML)"
)
POD_MIB_RULE = (
    "must be a whole number of MiB (a plain number such as 8192) or a byte quantity with a "
    "binary suffix that is a whole number of MiB (such as 8Gi)"
)
QUOTA_MIB_RULE = (
    "must be GPU memory as a whole number of MiB (such as 65536) or a byte quantity with a "
    "binary suffix that is a whole number of MiB (such as 64Gi)"
)


class UnitError(ValueError):
    """A value that is not in the expected unit; ``rule`` says what is expected."""

    def __init__(self, rule: str) -> None:
        super().__init__(rule)
        self.rule = rule


def ceil_div(a: int, b: int) -> int:
    """``a / b`` rounded up, for non-negative integers."""
    return -(-a // b)


def card_blocks(memory_mib: int) -> int:
    """Whole 256 MiB blocks a card of this size offers; the device plugin advertises as many."""
    return memory_mib // BLOCK_MIB


def parse_cards(raw: object, *, source: Source) -> int:
    """Cards as written → hundredths of a card (``"0.3"`` → 30, ``"4.5"`` → 450; 0 is 0).

    In a pod a value is a share of one card (0.01–1) or a whole number of cards; in a GPUQuota
    any non-negative number with at most two decimals (the module docstring says why).
    """
    rule = POD_CARDS_RULE if source == "pod" else QUOTA_CARDS_RULE
    try:
        q = parse_quantity(raw)
    except QuantityError:
        raise UnitError(rule) from None
    hundredths = q.value * CORE_PER_CARD
    if q.format == "binary" or q.value < 0 or hundredths != hundredths.to_integral_value():
        raise UnitError(rule)
    if source == "pod" and q.value > 1 and not q.is_integer:
        raise UnitError(rule)
    return int(hundredths)


def parse_mib(raw: object, *, source: Source) -> int:
    """GPU memory as written → MiB: a plain number is MiB, a binary suffix (``8Gi``) is bytes.

    A pod reads a decimal suffix as the number it denotes, a GPUQuota refuses it (the module
    docstring says why). Zero is returned as 0; callers that need at least 1 MiB say so.
    """
    rule = POD_MIB_RULE if source == "pod" else QUOTA_MIB_RULE
    try:
        q = parse_quantity(raw)
    except QuantityError:
        raise UnitError(rule) from None
    if q.format == "binary":
        mib = q.value / MIB
    elif (
        source == "pod" or isinstance(raw, int) or (isinstance(raw, str) and raw.strip().isdigit())
    ):
        mib = q.value
    else:
        raise UnitError(rule)
    if mib < 0 or mib != mib.to_integral_value():
        raise UnitError(rule)
    return int(mib)


def _plain_number(raw: object) -> bool:
    return isinstance(raw, int) or (isinstance(raw, str) and raw.strip().isdigit())


def format_cards(core: int) -> str:
    """Hundredths of a card as a user writes cards: 30 → ``0.3``, 200 → ``2``."""
    whole, hundredths = divmod(core, CORE_PER_CARD)
    if not hundredths:
        return str(whole)
    return f"{whole}.{hundredths:02d}".rstrip("0")


def cards_text(core: int) -> str:
    """Hundredths of a card with two places, as sums are reported: 370 → ``3.70``."""
    return f"{Decimal(core) / CORE_PER_CARD:.2f}"


def cards_phrase(core: int) -> str:
    """``0.50 card``, ``1.00 card``, ``4.00 cards``: singular up to one card."""
    return f"{cards_text(core)} {'card' if core <= CORE_PER_CARD else 'cards'}"


@dataclass(frozen=True, slots=True)
class Grant:
    """A container's canonical GPU resources.

    ``memory_blocks`` is 0 for whole cards admitted without a memory resource: they hold all
    the memory of each card they land on, which only the node knows, so admission neither
    needs the card model nor writes a size that a bigger card would then be held to. Whole
    cards admitted with memory (by earlier versions, or written so) keep it.
    """

    core: int
    memory_blocks: int

    @property
    def whole_cards(self) -> int:
        """Number of whole cards, or 0 for a share of one card."""
        return self.core // CORE_PER_CARD if self.core >= CORE_PER_CARD else 0

    @property
    def all_memory(self) -> bool:
        """Whole cards with all of their memory, however much the cards have."""
        return self.memory_blocks == 0

    @property
    def cards(self) -> Decimal:
        return Decimal(self.core) / CORE_PER_CARD

    @property
    def memory_mib(self) -> int:
        return self.memory_blocks * BLOCK_MIB

    @property
    def memory_mib_per_card(self) -> int:
        return self.memory_mib // max(self.whole_cards, 1)

    def resources(self) -> dict[str, str]:
        if self.all_memory:
            return {CORE: str(self.core)}
        return {CORE: str(self.core), MEMORY: str(self.memory_blocks)}

    def env(self) -> dict[str, str]:
        """What the application is told; the node agent adds the memory of whole cards."""
        if self.all_memory:
            return {ENV_GPU: format_cards(self.core)}
        return {ENV_GPU: format_cards(self.core), ENV_MEMORY_MIB: str(self.memory_mib_per_card)}

    @classmethod
    def from_resources(cls, resources: Mapping[str, Any]) -> Grant | None:
        """Read the canonical grant from a container's admitted ``limits`` (None if absent).

        Used on objects that admission already canonicalised; malformed values read as absent.
        """
        try:
            core = _integer(resources.get(CORE))
            memory = _integer(resources.get(MEMORY))
        except (QuantityError, ValueError):
            return None
        if core is None or core <= 0:
            return None
        if memory is None and core % CORE_PER_CARD == 0:
            return cls(core, 0)
        if memory is None or memory <= 0:
            return None
        return cls(core, memory)


def _integer(raw: object) -> int | None:
    if raw is None:
        return None
    q = parse_quantity(raw)
    if not q.is_integer:
        raise ValueError(raw)
    return int(q.value)
