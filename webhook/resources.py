"""The request language users write and the canonical form the cluster accounts.

This module owns both (design §1–2); every other component imports its names and arithmetic.

Input, per container, in ``resources.limits``:
    ``fracgpu.io/gpu``                 0.01–1 with two decimals, or whole cards
    ``fracgpu.io/gpumem``              MiB per card (plain number) or bytes (binary suffix)
    ``fracgpu.io/gpumem-percentage``   1–100 percent of the card's memory
    ``fracgpu.io/gpu-count``           on how many cards that share is given (DRA mode only)
    (and, when enabled, the HAMi and TKEStack dialects, normalised to the same request)

Canonical output, integers with requests = limits:
    ``fracgpu.io/core``    hundredths of a card; 1–100 a share of one card, 100·k = k cards
    ``fracgpu.io/memory``  256 MiB blocks of GPU memory, for shares of a card; whole cards
                           carry none (the canonical form with it is still accepted: earlier
                           versions wrote it, and it is kept as written)

Defaults where the user says less (documented in docs/user-guide.md):
    * a fraction without memory gets the same fraction of the card's memory, rounded *down* to
      whole blocks so that shares summing to one card always fit on it;
    * memory without a fraction gets the smallest share of compute that is at least the same
      fraction of the card (rounded *up* to 0.01), so memory-only pods are not starved;
    * whole cards always get all of the memory of the cards they land on; admission needs no
      card model for them, so a pod that would scale up a GPU node pool is admitted while the
      pool is empty, and a whole card on a bigger model is not held to a smaller one's size.
Percentages use the same block arithmetic as fractions, for the same reason.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from functools import lru_cache
from typing import Any

from core import dra
from core.contract import MAX_DEVICES
from core.labels import PRODUCT_LABEL
from core.policy import Priority
from core.quantity import MAX_CHARS, Quantity, QuantityError, format_decimal, parse_quantity
from core.units import (
    BLOCK_MIB,
    CANONICAL,
    CORE,
    CORE_PER_CARD,
    GPU,
    GPU_COUNT,
    GPUMEM,
    GPUMEM_PERCENTAGE,
    MEMORY,
    MIB,
    POD_MIB_RULE,
    Grant,
    UnitError,
    card_blocks,
    ceil_div,
    parse_cards,
    parse_mib,
)

# Dialects of other sharing systems (design §1).
HAMI_GPU = "nvidia.com/gpu"
HAMI_CORES = "nvidia.com/gpucores"
HAMI_MEM = "nvidia.com/gpumem"
HAMI_MEM_PERCENTAGE = "nvidia.com/gpumem-percentage"
HAMI_PRIORITY = "nvidia.com/priority"  # 0 high, 1 low (HAMi's default)
TKE_CORE = "tencent.com/vcuda-core"
TKE_MEMORY = "tencent.com/vcuda-memory"


class Dialect(StrEnum):
    FRACGPU = "fracgpu"
    CANONICAL = "canonical"
    HAMI = "hami"
    TKESTACK = "tkestack"
    DEVICE_CLASS = "device-class"


DIALECT_RESOURCES: dict[Dialect, tuple[str, ...]] = {
    Dialect.FRACGPU: (GPU, GPUMEM, GPUMEM_PERCENTAGE, GPU_COUNT),
    Dialect.CANONICAL: CANONICAL,
    Dialect.HAMI: (HAMI_GPU, HAMI_CORES, HAMI_MEM, HAMI_MEM_PERCENTAGE, HAMI_PRIORITY),
    Dialect.TKESTACK: (TKE_CORE, TKE_MEMORY),
    # The extended resource Kubernetes gives fracgpu's DeviceClass (on by default in 1.36, GA in
    # 1.37): a pod asking for it would get whole cards from a claim the scheduler makes after
    # admission, which neither webhook sees; it is taken as whole cards in fracgpu's form.
    Dialect.DEVICE_CLASS: (dra.DEVICE_CLASS_RESOURCE,),
}
# Always understood: ours, the canonical form and the DeviceClass's extended resource (a way to a
# card that must never go uncounted). The others can be switched on.
ALWAYS_ON = frozenset({Dialect.FRACGPU, Dialect.CANONICAL, Dialect.DEVICE_CLASS})
OPTIONAL_DIALECTS = frozenset(Dialect) - ALWAYS_ON


@dataclass(frozen=True, slots=True)
class Card:
    """A GPU model as the inventory knows it."""

    product: str
    memory_mib: int


@dataclass(frozen=True, slots=True)
class CardChoice:
    """The cards a pod's request may be sized against, chosen by the inventory from placement.

    ``cards`` are the candidate models, smallest first: the smallest sizes fractions and
    percentages (the share then fits wherever the pod lands), the largest bounds explicit
    memory, and a memory-only request is sized for the smallest that holds it. With no
    candidate, ``unknown`` says what the operator must configure. ``pin`` is the label a pod
    pins a model with, for the warning shown when several models were possible.
    """

    cards: tuple[Card, ...] = ()
    pin: str = PRODUCT_LABEL
    unknown: str = "no GPU models are known to fracgpu"

    @property
    def card(self) -> Card | None:
        return self.cards[0] if self.cards else None

    @property
    def largest(self) -> Card | None:
        return self.cards[-1] if self.cards else None

    def fitting(self, blocks: int) -> Card | None:
        """The smallest candidate with at least ``blocks`` of memory (else the smallest)."""
        for card in self.cards:
            if card_blocks(card.memory_mib) >= blocks:
                return card
        return self.card

    def warning(self, used: Card) -> str | None:
        """Shown when the pod may land on a model with another size than the one used."""
        if all(c.memory_mib == used.memory_mib for c in self.cards):
            return None
        which = "the smallest" if used == self.card else "the smallest that holds the request"
        return (
            f"sized for {used.product} ({used.memory_mib} MiB), {which} of {len(self.cards)} "
            f"GPU models it may land on; pin a model with nodeSelector {self.pin} to size for "
            f"another"
        )


class RequestError(ValueError):
    """A request fracgpu cannot honour, phrased for the person who wrote it."""


@dataclass(slots=True)
class ContainerResult:
    """The outcome of normalising one container."""

    name: str
    grant: Grant | None = None
    request: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    zero: bool = False  # asked for 0 cards: no GPU, but the input resources must be removed
    ask: Ask | None = None  # what was asked, before sizing (DRA mode sizes it per card model)

    @property
    def mentions_gpu(self) -> bool:
        return bool(self.request) or bool(self.errors) or self.zero


@dataclass(frozen=True, slots=True)
class Ask:
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


def input_resources(dialects: Iterable[Dialect]) -> frozenset[str]:
    """Every resource name the webhook rewrites, given the enabled dialects."""
    return _input_resources(enabled(dialects))


@lru_cache(maxsize=16)
def _input_resources(dialects: tuple[Dialect, ...]) -> frozenset[str]:
    names: set[str] = set()
    for dialect in dialects:
        names.update(DIALECT_RESOURCES[dialect])
    return frozenset(names)


def enabled(dialects: Iterable[Dialect]) -> tuple[Dialect, ...]:
    """The dialects in force: ours and the canonical form always, plus the enabled ones."""
    return _enabled(frozenset(dialects))


@lru_cache(maxsize=16)
def _enabled(dialects: frozenset[Dialect]) -> tuple[Dialect, ...]:
    chosen = {*ALWAYS_ON, *dialects}
    return tuple(d for d in Dialect if d in chosen)


DEFAULT_MAX_CARDS = MAX_DEVICES
"""Whole cards one container may ask for (``admission.max_cards``): as many as a container's
limits file can name, more than most nodes have."""


def normalise_container(
    name: str,
    resources: Mapping[str, Any] | None,
    dialects: Iterable[Dialect],
    card: CardChoice,
    max_cards: int = DEFAULT_MAX_CARDS,
    *,
    sized: bool = True,
) -> ContainerResult:
    """Validate one container's GPU request and compute its canonical grant.

    Never raises: every problem becomes a message in ``errors`` that names the container, the
    resource, the value and the rule. With ``sized=False`` (DRA mode) only ``ask`` is set: the
    claim, not the grant, is sized for each card model (``webhook.claims``).
    """
    result = ContainerResult(name)
    active = enabled(dialects)
    mine = _input_resources(active)
    resources = resources if isinstance(resources, dict) else {}
    limits = resources.get("limits") or {}
    requests = resources.get("requests") or {}
    if not isinstance(limits, dict) or not isinstance(requests, dict):
        result.errors.append(f"{container_ref(name)}: resources.limits and requests must be maps")
        return result
    asked = {k: v for k, v in limits.items() if k in mine}
    ceiling = 0
    for key, value in requests.items():
        if key not in mine:
            continue
        if key not in limits:
            result.errors.append(
                f"{container_ref(name)}: {key} is set in requests ({_show(value)}) but not in "
                f"limits; GPU resources are set in limits (requests may be omitted)"
            )
        elif value != limits[key] and not _same_quantity(value, limits[key]):
            if key == GPU:
                try:
                    ceiling = _burst(name, value, limits[key])
                    asked[key] = value  # the request is the guarantee
                    continue
                except RequestError as exc:
                    result.errors.append(str(exc))
                    continue
            result.errors.append(
                f"{container_ref(name)}: {key} request {_show(value)} differs from its limit "
                f"{_show(limits[key])}; set only limits, or make requests equal to limits"
                + (
                    f" (only {GPU} may ask less in requests than in limits: GPU memory is "
                    f"never lent, since an allocation cannot be taken back)"
                    if key in (GPUMEM, GPUMEM_PERCENTAGE)
                    else ""
                )
            )
    result.request = {k: _show(v) for k, v in asked.items()}
    if ceiling:
        result.request[f"limits.{GPU}"] = _show(limits[GPU])
    if result.errors or not asked:
        return result
    used = sorted({_DIALECT_OF[k] for k in asked}, key=active.index)
    if len(used) > 1:
        names = " and ".join(", ".join(k for k in DIALECT_RESOURCES[d] if k in asked) for d in used)
        result.errors.append(
            f"{container_ref(name)}: mixes resources of different vocabularies ({names}); "
            f"use one of them per container"
        )
        return result
    try:
        ask = _PARSERS[used[0]](name, asked)
        if ask is None:  # an explicit zero: no GPU
            result.request = {}
            result.zero = True
            return result
        if ceiling:
            ask = replace(ask, ceiling=ceiling)
        result.ask = ask
        if ask.count > 1 and not sized:
            _check_count(name, ask, max_cards)
        elif ask.count > 1:
            raise RequestError(several_cards_need_dra(name, ask))
        if sized:
            result.grant = resolve(name, ask, card, max_cards, result.warnings)
    except RequestError as exc:
        result.errors.append(str(exc))
    return result


def _burst(name: str, request: object, limit: object) -> int:
    """A share's request below its limit: guaranteed the request, bursting to the limit into
    compute the card's other shares leave idle. The ceiling in hundredths; RequestError when
    the two do not make a share of one card that may burst."""
    rule = (
        f"{GPU} in requests is the share's guarantee and in limits the most it may burst to, "
        f"both shares of one card (0.01–1), the request below the limit"
    )
    guarantee = _cards(name, GPU, request)
    ceiling = _cards(name, GPU, limit)
    if guarantee is None or ceiling is None or guarantee > CORE_PER_CARD or ceiling > CORE_PER_CARD:
        raise RequestError(
            f"{container_ref(name)}: {GPU} request {_show(request)} and limit {_show(limit)}: "
            f"{rule}; whole cards are never throttled, so give them in limits alone"
        )
    if guarantee > ceiling:
        raise RequestError(
            f"{container_ref(name)}: {GPU} request {_show(request)} is more than its limit "
            f"{_show(limit)}: {rule}"
        )
    return ceiling


def container_ref(name: str) -> str:
    """How every message names a container: ``container "train"``, as kubectl users read it."""
    return f"container {json.dumps(name)}"


def quote(raw: object) -> str:
    """Any JSON value as a denial quotes it: as JSON, and short.

    A denial quotes what it refuses, not megabytes of it; and Python will not print an integer
    of more than 4,300 digits, which a hostile object can hold.
    """
    try:
        text = json.dumps(raw)
    except ValueError:
        return f"a number of {int.bit_length(raw)} bits" if isinstance(raw, int) else "a value"
    if len(text) > MAX_CHARS:
        return f"{text[:MAX_CHARS]}… ({len(text)} characters)"
    return text


def _show(raw: object) -> str:
    """The value as the user most likely wrote it (``1500m`` reads back as ``1.5``)."""
    if isinstance(raw, str | int | float) and not isinstance(raw, bool):
        return _show_scalar(raw)
    return _show_any(raw)


# Admission shows the same few spellings over and over; Decimal formatting is not cheap.
@lru_cache(maxsize=4096, typed=True)
def _show_scalar(raw: str | int | float) -> str:
    return _show_any(raw)


def _show_any(raw: object) -> str:
    try:
        q = parse_quantity(raw)
    except QuantityError:
        return quote(raw)
    if q.format == "binary" or not isinstance(raw, str):
        return raw.strip() if isinstance(raw, str) else format_decimal(q.value)
    return format_decimal(q.value)


def _same_quantity(a: object, b: object) -> bool:
    try:
        return parse_quantity(a).value == parse_quantity(b).value
    except QuantityError:
        return a == b


def _quantity(name: str, key: str, raw: object, rule: str) -> Quantity:
    try:
        q = parse_quantity(raw)
    except QuantityError:
        raise RequestError(f"{container_ref(name)}: {key} {rule}; got {_show(raw)}") from None
    if q.value < 0:
        raise RequestError(f"{container_ref(name)}: {key} {rule}; got {_show(raw)}")
    return q


def _cards(name: str, key: str, raw: object) -> int | None:
    """Parse a card count into hundredths; None for zero."""
    try:
        core = parse_cards(raw, source="pod")
    except UnitError as exc:
        raise RequestError(f"{container_ref(name)}: {key} {exc.rule}; got {_show(raw)}") from None
    return core or None


def _mib(name: str, key: str, raw: object) -> int:
    try:
        mib = parse_mib(raw, source="pod")
    except UnitError as exc:
        raise RequestError(f"{container_ref(name)}: {key} {exc.rule}; got {_show(raw)}") from None
    if mib < 1:
        raise RequestError(f"{container_ref(name)}: {key} {POD_MIB_RULE}; got {_show(raw)}")
    return mib


def _percent(name: str, key: str, raw: object) -> int:
    rule = "must be a whole percentage between 1 and 100"
    q = _quantity(name, key, raw, rule)
    if q.format == "binary" or not q.is_integer or not 1 <= q.value <= 100:
        raise RequestError(f"{container_ref(name)}: {key} {rule}; got {_show(raw)}")
    return int(q.value)


def _count(name: str, key: str, raw: object, what: str) -> int:
    rule = f"must be a whole number of {what}"
    q = _quantity(name, key, raw, rule)
    if q.format == "binary" or not q.is_integer:
        raise RequestError(f"{container_ref(name)}: {key} {rule}; got {_show(raw)}")
    return int(q.value)


def _memory(name: str, asked: Mapping[str, Any], mib_key: str, pct_key: str) -> Ask:
    if mib_key in asked and pct_key in asked:
        raise RequestError(
            f"{container_ref(name)}: {mib_key} and {pct_key} are both set; "
            f"give GPU memory one way, either in MiB or as a percentage"
        )
    if mib_key in asked:
        return Ask(memory_mib=_mib(name, mib_key, asked[mib_key]))
    if pct_key in asked:
        return Ask(memory_percent=_percent(name, pct_key, asked[pct_key]))
    return Ask()


def _parse_fracgpu(name: str, asked: Mapping[str, Any]) -> Ask | None:
    memory = _memory(name, asked, GPUMEM, GPUMEM_PERCENTAGE)
    count = 1
    if GPU_COUNT in asked:
        count = _count(name, GPU_COUNT, asked[GPU_COUNT], "cards")
        if count < 1:
            raise RequestError(
                f"{container_ref(name)}: {GPU_COUNT} must be a whole number of cards, at least "
                f"1; got {_show(asked[GPU_COUNT])}; remove it for one card"
            )
        if GPU not in asked and memory == Ask():
            raise RequestError(
                f"{container_ref(name)}: {GPU_COUNT} is set without a share to give on each "
                f"card; add {GPU} (for example 0.3) or {GPUMEM}"
            )
    if GPU not in asked:
        return replace(memory, count=count, count_key=GPU_COUNT) if count > 1 else memory
    core = _cards(name, GPU, asked[GPU])
    if core is None:
        if memory != Ask() or count > 1:
            what = "GPU memory is" if memory != Ask() else f"{GPU_COUNT} is"
            raise RequestError(
                f"{container_ref(name)}: {GPU} is 0 but {what} requested; "
                f"ask for a share of a card (e.g. {GPU}: 0.1) or remove the other resources"
            )
        return None
    if count > 1 and core > CORE_PER_CARD:
        raise RequestError(
            f"{container_ref(name)}: {GPU} {_show(asked[GPU])} is whole cards, and "
            f"{GPU_COUNT} says on how many cards a share is given; write {GPU}: "
            f"{_show(asked[GPU])} alone for whole cards, or a share (0.01–1) with {GPU_COUNT}"
        )
    if count > 1 and core == CORE_PER_CARD:
        # One whole card on each of N cards is N whole cards: the form that needs no DRA.
        return Ask(
            core * count,
            memory.memory_mib,
            None,
            memory.memory_percent,
            core_key=GPU_COUNT,
            core_shown=str(count),
        )
    return Ask(
        core,
        memory.memory_mib,
        None,
        memory.memory_percent,
        core_key=GPU,
        core_shown=_show(asked[GPU]),
        count=count,
        count_key=GPU_COUNT if count > 1 else "",
    )


def _parse_canonical(name: str, asked: Mapping[str, Any]) -> Ask | None:
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
    shown = _show(asked[CORE]) if CORE in asked else ""
    return Ask(
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


def _parse_hami(name: str, asked: Mapping[str, Any]) -> Ask | None:
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
            f"{_show(asked[HAMI_PRIORITY])}"
        )
    # HAMi lets a prioritised share use compute the card leaves idle (a low one alone on a card
    # may use all of it): here, a guarantee of its gpucores that may burst to the whole card.
    priority = Priority.HIGH if level == 0 else Priority.LOW
    whole = ask.core is not None and ask.core >= CORE_PER_CARD
    return ask if whole else replace(ask, ceiling=CORE_PER_CARD, priority=priority)


def _parse_hami_share(name: str, asked: Mapping[str, Any]) -> Ask | None:
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
        return Ask(
            count * CORE_PER_CARD,
            memory.memory_mib,
            None,
            memory.memory_percent,
            core_key=HAMI_GPU,
            core_shown=str(count),
        )
    if count > 1:
        # HAMi's N cards with a share of each: the same share on each of N cards.
        return Ask(
            cores or None,
            memory.memory_mib,
            None,
            memory.memory_percent,
            count=count,
            count_key=HAMI_GPU,
        )
    if cores == 0 and memory == Ask():
        return Ask(core=CORE_PER_CARD)  # HAMi's default: one whole card
    return Ask(cores or None, memory.memory_mib, None, memory.memory_percent)


def _parse_tke(name: str, asked: Mapping[str, Any]) -> Ask | None:
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
    shown = _show(asked[TKE_CORE]) if TKE_CORE in asked else ""
    return Ask(
        core=core, memory_blocks=_per_card(core, blocks), core_key=TKE_CORE, core_shown=shown
    )


def _parse_device_class(name: str, asked: Mapping[str, Any]) -> Ask | None:
    key = dra.DEVICE_CLASS_RESOURCE
    count = _count(name, key, asked[key], "cards")
    if count == 0:
        return None
    return Ask(core=count * CORE_PER_CARD, core_key=key, core_shown=str(count))


_DIALECT_OF = {name: d for d, names in DIALECT_RESOURCES.items() for name in names}

_PARSERS = {
    Dialect.FRACGPU: _parse_fracgpu,
    Dialect.CANONICAL: _parse_canonical,
    Dialect.HAMI: _parse_hami,
    Dialect.TKESTACK: _parse_tke,
    Dialect.DEVICE_CLASS: _parse_device_class,
}


def several_cards_need_dra(name: str, ask: Ask) -> str:
    """Device-plugin mode's denial of a share of several cards, in the user's terms.

    kubelet's device manager hands a container devices from one resource, summed: it cannot say
    that 60 hundredths are 30 on each of two cards, and a plugin that guessed would fail pods
    on the node. One DRA claim request with ``count`` and capacity per card says exactly that.
    """
    return (
        f"{container_ref(name)}: asks for a share of each of {ask.count} cards "
        f"({ask.count_key}: {ask.count}); in device-plugin mode a container gets a share of one "
        f"card or whole cards, and only DRA mode (Kubernetes 1.36 and newer) can give a share "
        f"of several; ask the operator for DRA mode (kubectl fracgpu mode), or ask for whole "
        f"cards, or for one card's share"
    )


def _check_count(name: str, ask: Ask, max_cards: int) -> None:
    if ask.count > max_cards:
        raise RequestError(
            f"{container_ref(name)}: {ask.count_key} asks for a share of {ask.count} cards; a "
            f"container may have at most {max_cards} cards (admission.max_cards); ask for fewer"
        )


def _need_card(name: str, choice: CardChoice, why: str) -> Card:
    if choice.card is None:
        raise RequestError(
            f"{container_ref(name)}: cannot {why}: {choice.unknown}; set fracgpu.io/gpumem "
            f"together with fracgpu.io/gpu, or have the operator configure the GPU inventory "
            f"(node labels fracgpu.io/gpu.product and fracgpu.io/gpu.memory-mib, or "
            f"inventory.models in the webhook configuration)"
        )
    return choice.card


def resolve(name: str, ask: Ask, choice: CardChoice, max_cards: int, warnings: list[str]) -> Grant:
    """Apply card sizes and defaults to what was asked; the only place defaults live."""
    blocks = ask.memory_blocks
    if ask.memory_mib is not None:
        blocks = ceil_div(ask.memory_mib, BLOCK_MIB)
    if blocks is not None:
        _check_fits(name, ask, blocks, choice)
    core = ask.core
    if core is not None and core >= CORE_PER_CARD:
        return _whole_cards(name, ask, blocks, max_cards, warnings)
    if ask.memory_mib is not None and blocks is not None and blocks * BLOCK_MIB != ask.memory_mib:
        warnings.append(
            f"{container_ref(name)}: {ask.memory_mib} MiB of GPU memory rounded up to "
            f"{blocks * BLOCK_MIB} MiB (GPU memory is granted in {BLOCK_MIB} MiB blocks)"
        )
    used: Card | None = None
    if blocks is None:
        percent = ask.memory_percent
        used = _need_card(
            name,
            choice,
            "work out GPU memory for the request"
            if percent is None
            else "convert fracgpu.io/gpumem-percentage to MiB",
        )
        share = percent if percent is not None else core
        assert share is not None  # a request names at least one of core and memory
        blocks = max(1, card_blocks(used.memory_mib) * share // 100)
    if core is None:
        _need_card(name, choice, "work out the card share for a memory-only request")
        # Sized for the smallest model that holds it: a smaller one cannot host the pod.
        used = choice.fitting(blocks)
        assert used is not None
        per_card = max(card_blocks(used.memory_mib), 1)
        core = min(CORE_PER_CARD, max(1, ceil_div(blocks * CORE_PER_CARD, per_card)))
    warning = choice.warning(used) if used is not None else None
    if warning:
        warnings.append(f"{container_ref(name)}: {warning}")
    return Grant(core, blocks)


def _whole_cards(
    name: str, ask: Ask, blocks: int | None, max_cards: int, warnings: list[str]
) -> Grant:
    """Whole cards need no card model: they get all of each card, which the node knows."""
    assert ask.core is not None
    core = ask.core
    cards = core // CORE_PER_CARD
    if cards > max_cards:
        raise RequestError(
            f"{container_ref(name)}: {ask.core_key} asks for more whole cards than a node has: "
            f"a container may have at most {max_cards} cards (admission.max_cards); "
            f"got {ask.core_shown}; ask for fewer cards"
        )
    if ask.exact:
        # Our own output, or a tool's: kept as is, so admitting it again changes nothing.
        return Grant(core, 0 if blocks is None else blocks * cards)
    if blocks is not None or (ask.memory_percent or 100) < 100:
        warnings.append(
            f"{container_ref(name)}: whole cards come with all of their memory; "
            f"the memory limit is ignored"
        )
    return Grant(core, 0)


MAX_CARD_MIB = 2**20
"""No GPU has a TiB of memory: more is a typo (bytes written as MiB), known models or not."""


def _check_fits(name: str, ask: Ask, blocks: int, choice: CardChoice) -> None:
    """Deny memory that no candidate card has: it would only fail later, on the node.

    The canonical form is held only to what any card could have: it was sized against the
    candidates when it was first admitted, and they may be scaled to zero now.
    """
    largest = None if ask.exact else choice.largest
    if largest is None:
        limit, what = card_blocks(MAX_CARD_MIB), "any GPU"
    else:
        limit, what = card_blocks(largest.memory_mib), largest.product
    if blocks <= limit:
        return
    hint = ""
    if ask.memory_mib is not None and ask.memory_mib >= MIB:
        hint = " (a plain number is MiB; write a binary suffix such as 8Gi for bytes)"
    raise RequestError(
        f"{container_ref(name)}: asks for {blocks * BLOCK_MIB} MiB of GPU memory per card, more "
        f"than {what} has ({limit * BLOCK_MIB} MiB usable); ask for less memory, or for whole "
        f"cards{hint}"
    )
