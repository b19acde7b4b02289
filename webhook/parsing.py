"""Each vocabulary's resources read into one ``ContainerAsk``: what a container asked for.

A container asks in one vocabulary (``webhook.dialects``); its parser checks every value and
says what was asked, in hundredths of a card and memory as the user gave it, before any card's
size is applied (``webhook.sizing`` does that, or ``webhook.claims`` per GPU model in DRA
mode). Every problem is a ``RequestError`` naming the container, the resource, the value and
the rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from core import dra
from core.policy import Priority
from core.quantity import Quantity, QuantityError, parse_quantity
from core.units import (
    BLOCK_MIB,
    CORE,
    CORE_PER_CARD,
    GPU,
    GPU_COUNT,
    GPUMEM,
    GPUMEM_PERCENTAGE,
    MEMORY,
    POD_MIB_RULE,
    UnitError,
    ceil_div,
    parse_cards,
    parse_mib,
)
from webhook.dialects import (
    DIALECT_OF,
    DIALECT_RESOURCES,
    HAMI_CORES,
    HAMI_GPU,
    HAMI_MEM,
    HAMI_MEM_PERCENTAGE,
    HAMI_PRIORITY,
    TKE_CORE,
    TKE_MEMORY,
    Dialect,
)
from webhook.wording import container_ref, show


class RequestError(ValueError):
    """A request fracgpu cannot honour, phrased for the person who wrote it."""


@dataclass(frozen=True, slots=True)
class ContainerAsk:
    """What one container asked, in one vocabulary, before card sizes are applied."""

    core: int | None = None  # None: derive from memory
    memory_mib: int | None = None  # exact MiB the user wrote
    memory_blocks: int | None = None  # TKEStack / canonical blocks
    memory_percent: int | None = None
    exact: bool = False  # the canonical form: kept as written, never re-sized
    core_key: str = ""  # the resource that set ``core``, and its value as written
    core_shown: str = ""
    # A share (core below a card) given on this many cards, the same share on each: one claim
    # request with ``count`` in DRA mode; device-plugin mode cannot grant it. Whole cards say
    # their number in ``core`` and keep 1 here.
    count: int = 1
    count_key: str = ""  # the resource that set ``count``, for messages
    # Burst: the most compute (hundredths of a card) the share may use while the card has idle
    # compute, from ``limits`` when ``requests`` asks less (the guarantee, in ``core``); 0: a
    # hard cap. ``priority`` when the request said one (HAMi's nvidia.com/priority).
    ceiling: int = 0
    priority: Priority | None = None


def _quantity(name: str, key: str, raw: object, rule: str) -> Quantity:
    try:
        q = parse_quantity(raw)
    except QuantityError:
        raise RequestError(f"{container_ref(name)}: {key} {rule}; got {show(raw)}") from None
    if q.value < 0:
        raise RequestError(f"{container_ref(name)}: {key} {rule}; got {show(raw)}")
    return q


def card_hundredths(name: str, key: str, raw: object) -> int | None:
    """Parse a card count into hundredths; None for zero."""
    try:
        core = parse_cards(raw, source="pod")
    except UnitError as exc:
        raise RequestError(f"{container_ref(name)}: {key} {exc.rule}; got {show(raw)}") from None
    return core or None


def _mib(name: str, key: str, raw: object) -> int:
    try:
        mib = parse_mib(raw, source="pod")
    except UnitError as exc:
        raise RequestError(f"{container_ref(name)}: {key} {exc.rule}; got {show(raw)}") from None
    if mib < 1:
        raise RequestError(f"{container_ref(name)}: {key} {POD_MIB_RULE}; got {show(raw)}")
    return mib


def _percent(name: str, key: str, raw: object) -> int:
    rule = "must be a whole percentage between 1 and 100"
    q = _quantity(name, key, raw, rule)
    if q.format == "binary" or not q.is_integer or not 1 <= q.value <= 100:
        raise RequestError(f"{container_ref(name)}: {key} {rule}; got {show(raw)}")
    return int(q.value)


def _count(name: str, key: str, raw: object, what: str) -> int:
    rule = f"must be a whole number of {what}"
    q = _quantity(name, key, raw, rule)
    if q.format == "binary" or not q.is_integer:
        raise RequestError(f"{container_ref(name)}: {key} {rule}; got {show(raw)}")
    return int(q.value)


def _memory(name: str, asked: Mapping[str, Any], mib_key: str, pct_key: str) -> ContainerAsk:
    if mib_key in asked and pct_key in asked:
        raise RequestError(
            f"{container_ref(name)}: {mib_key} and {pct_key} are both set; "
            f"give GPU memory one way, either in MiB or as a percentage"
        )
    if mib_key in asked:
        return ContainerAsk(memory_mib=_mib(name, mib_key, asked[mib_key]))
    if pct_key in asked:
        return ContainerAsk(memory_percent=_percent(name, pct_key, asked[pct_key]))
    return ContainerAsk()


def _parse_fracgpu(name: str, asked: Mapping[str, Any]) -> ContainerAsk | None:
    memory = _memory(name, asked, GPUMEM, GPUMEM_PERCENTAGE)
    count = 1
    if GPU_COUNT in asked:
        count = _count(name, GPU_COUNT, asked[GPU_COUNT], "cards")
        if count < 1:
            raise RequestError(
                f"{container_ref(name)}: {GPU_COUNT} must be a whole number of cards, at least "
                f"1; got {show(asked[GPU_COUNT])}; remove it for one card"
            )
        if GPU not in asked and memory == ContainerAsk():
            raise RequestError(
                f"{container_ref(name)}: {GPU_COUNT} is set without a share to give on each "
                f"card; add {GPU} (for example 0.3) or {GPUMEM}"
            )
    if GPU not in asked:
        return replace(memory, count=count, count_key=GPU_COUNT) if count > 1 else memory
    core = card_hundredths(name, GPU, asked[GPU])
    if core is None:
        if memory != ContainerAsk() or count > 1:
            what = "GPU memory is" if memory != ContainerAsk() else f"{GPU_COUNT} is"
            raise RequestError(
                f"{container_ref(name)}: {GPU} is 0 but {what} requested; "
                f"ask for a share of a card (e.g. {GPU}: 0.1) or remove the other resources"
            )
        return None
    if count > 1 and core > CORE_PER_CARD:
        raise RequestError(
            f"{container_ref(name)}: {GPU} {show(asked[GPU])} is whole cards, and "
            f"{GPU_COUNT} says on how many cards a share is given; write {GPU}: "
            f"{show(asked[GPU])} alone for whole cards, or a share (0.01–1) with {GPU_COUNT}"
        )
    if count > 1 and core == CORE_PER_CARD:
        # One whole card on each of N cards is N whole cards: the form that needs no DRA.
        return ContainerAsk(
            core * count,
            memory.memory_mib,
            None,
            memory.memory_percent,
            core_key=GPU_COUNT,
            core_shown=str(count),
        )
    return ContainerAsk(
        core,
        memory.memory_mib,
        None,
        memory.memory_percent,
        core_key=GPU,
        core_shown=show(asked[GPU]),
        count=count,
        count_key=GPU_COUNT if count > 1 else "",
    )


def _parse_canonical(name: str, asked: Mapping[str, Any]) -> ContainerAsk | None:
    core = None
    if CORE in asked:
        core = _count(name, CORE, asked[CORE], "hundredths of a card")
        if core == 0:
            if MEMORY in asked:
                raise RequestError(f"{container_ref(name)}: {CORE} is 0 but {MEMORY} is set")
            return None
        if core > CORE_PER_CARD and core % CORE_PER_CARD:
            raise RequestError(
                f"{container_ref(name)}: {CORE} must be 1–100 (a share of one card) or a multiple "
                f"of 100 (whole cards); got {core}"
            )
    blocks = None
    if MEMORY in asked:
        blocks = _count(name, MEMORY, asked[MEMORY], f"{BLOCK_MIB} MiB blocks")
        if blocks == 0:
            raise RequestError(
                f"{container_ref(name)}: {MEMORY} must be at least 1 block of {BLOCK_MIB} MiB"
            )
    shown = show(asked[CORE]) if CORE in asked else ""
    return ContainerAsk(
        core=core,
        memory_blocks=_per_card(core, blocks),
        exact=True,
        core_key=CORE,
        core_shown=shown,
    )


def _per_card(core: int | None, blocks: int | None) -> int | None:
    """Canonical memory counts every card of the container; the rest of the arithmetic is per
    card, so whole-card totals are divided back (re-admitting our own output is a no-op)."""
    if core is None or blocks is None or core < CORE_PER_CARD:
        return blocks
    cards = core // CORE_PER_CARD
    return ceil_div(blocks, cards)


def _parse_hami(name: str, asked: Mapping[str, Any]) -> ContainerAsk | None:
    if asked.keys() <= {HAMI_PRIORITY}:
        raise RequestError(
            f"{container_ref(name)}: {HAMI_PRIORITY} is set without a GPU; it orders shares of "
            f"a card, so add {HAMI_GPU} (and {HAMI_CORES} or {HAMI_MEM}), or remove it"
        )
    ask = _parse_hami_share(name, asked)
    if ask is None or HAMI_PRIORITY not in asked:
        return ask
    level = _count(name, HAMI_PRIORITY, asked[HAMI_PRIORITY], "priority (0 high, 1 low)")
    if level not in (0, 1):
        raise RequestError(
            f"{container_ref(name)}: {HAMI_PRIORITY} must be 0 (high) or 1 (low); got "
            f"{show(asked[HAMI_PRIORITY])}"
        )
    # HAMi lets a prioritised share use compute the card leaves idle (a low one alone on a card
    # may use all of it): here, a guarantee of its gpucores that may burst to the whole card.
    priority = Priority.HIGH if level == 0 else Priority.LOW
    whole = ask.core is not None and ask.core >= CORE_PER_CARD
    return ask if whole else replace(ask, ceiling=CORE_PER_CARD, priority=priority)


def _parse_hami_share(name: str, asked: Mapping[str, Any]) -> ContainerAsk | None:
    memory = _memory(name, asked, HAMI_MEM, HAMI_MEM_PERCENTAGE)
    count = _count(name, HAMI_GPU, asked.get(HAMI_GPU, 1), "cards")
    cores = _count(name, HAMI_CORES, asked.get(HAMI_CORES, 0), "percent")
    if cores > 100:
        raise RequestError(
            f"{container_ref(name)}: {HAMI_CORES} must be a percentage between 0 and 100; "
            f"got {cores}"
        )
    if count == 0:
        return None
    whole = memory.memory_mib is None and memory.memory_percent in (None, 100)
    if count > 1 and (cores == CORE_PER_CARD or (cores == 0 and whole)):
        # All of each card's compute: whole cards (a memory limit is ignored with a warning).
        return ContainerAsk(
            count * CORE_PER_CARD,
            memory.memory_mib,
            None,
            memory.memory_percent,
            core_key=HAMI_GPU,
            core_shown=str(count),
        )
    if count > 1:
        # HAMi's N cards with a share of each: the same share on each of N cards.
        return ContainerAsk(
            cores or None,
            memory.memory_mib,
            None,
            memory.memory_percent,
            count=count,
            count_key=HAMI_GPU,
        )
    if cores == 0 and memory == ContainerAsk():
        return ContainerAsk(core=CORE_PER_CARD)  # HAMi's default: one whole card
    return ContainerAsk(cores or None, memory.memory_mib, None, memory.memory_percent)


def _parse_tke(name: str, asked: Mapping[str, Any]) -> ContainerAsk | None:
    core = None
    if TKE_CORE in asked:
        core = _count(name, TKE_CORE, asked[TKE_CORE], "hundredths of a card")
        if core > CORE_PER_CARD and core % CORE_PER_CARD:
            raise RequestError(
                f"{container_ref(name)}: {TKE_CORE} must be 1–100 or a multiple of 100; got {core}"
            )
        if core == 0:
            return None
    blocks = (
        _count(name, TKE_MEMORY, asked[TKE_MEMORY], "256 MiB units")
        if (TKE_MEMORY in asked)
        else None
    )
    if blocks == 0:
        raise RequestError(f"{container_ref(name)}: {TKE_MEMORY} must be at least 1 (256 MiB)")
    shown = show(asked[TKE_CORE]) if TKE_CORE in asked else ""
    return ContainerAsk(
        core=core, memory_blocks=_per_card(core, blocks), core_key=TKE_CORE, core_shown=shown
    )


def _parse_device_class(name: str, asked: Mapping[str, Any]) -> ContainerAsk | None:
    key = dra.DEVICE_CLASS_RESOURCE
    count = _count(name, key, asked[key], "cards")
    if count == 0:
        return None
    return ContainerAsk(core=count * CORE_PER_CARD, core_key=key, core_shown=str(count))


_PARSERS = {
    Dialect.FRACGPU: _parse_fracgpu,
    Dialect.CANONICAL: _parse_canonical,
    Dialect.HAMI: _parse_hami,
    Dialect.TKESTACK: _parse_tke,
    Dialect.DEVICE_CLASS: _parse_device_class,
}


def parse_ask(
    name: str, asked: Mapping[str, Any], active: tuple[Dialect, ...]
) -> ContainerAsk | None:
    """What a container's GPU resources ask, read in their one vocabulary; None for an explicit
    zero (no GPU). ``active``: the dialects in force, in ``Dialect`` order."""
    used = sorted({DIALECT_OF[k] for k in asked}, key=active.index)
    if len(used) > 1:
        names = " and ".join(", ".join(k for k in DIALECT_RESOURCES[d] if k in asked) for d in used)
        raise RequestError(
            f"{container_ref(name)}: mixes resources of different vocabularies ({names}); "
            f"use one of them per container"
        )
    return _PARSERS[used[0]](name, asked)
