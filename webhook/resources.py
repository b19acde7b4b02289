"""The request language users write, read into the canonical form the cluster accounts.

This module is the entry point of both (design §1–2): ``normalise_container`` reads one
container's GPU resources and says what it is granted, or everything that is wrong with it.
Admission (``webhook.mutation``, and ``fracgpu review``, which runs the same mutator) calls it;
the canonical units and their arithmetic are ``core.units``', which every component shares.

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

The steps have their own modules: the vocabularies (``webhook.dialects``), reading each into
what was asked (``webhook.parsing``), and sizing that for a card with the defaults where the
user says less (``webhook.sizing``). This module reads ``requests`` against ``limits``: only
``fracgpu.io/gpu`` may ask less in requests, a share that may burst.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from core.quantity import QuantityError, parse_quantity
from core.units import CORE_PER_CARD, GPU, GPUMEM, GPUMEM_PERCENTAGE, Grant
from webhook.dialects import Dialect, enabled, input_resources
from webhook.gpumodels import CardChoice
from webhook.parsing import ContainerAsk, RequestError, card_hundredths, parse_ask
from webhook.sizing import DEFAULT_MAX_CARDS, check_count, resolve, several_cards_need_dra
from webhook.wording import container_ref, show


@dataclass(slots=True)
class ContainerResult:
    """The outcome of normalising one container."""

    name: str
    grant: Grant | None = None
    request: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    zero: bool = False  # asked for 0 cards: no GPU, but the input resources must be removed
    ask: ContainerAsk | None = None  # what was asked, before sizing (DRA mode sizes it per model)

    @property
    def mentions_gpu(self) -> bool:
        return bool(self.request) or bool(self.errors) or self.zero


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
    resources = resources if isinstance(resources, dict) else {}
    limits = resources.get("limits") or {}
    requests = resources.get("requests") or {}
    if not isinstance(limits, dict) or not isinstance(requests, dict):
        result.errors.append(f"{container_ref(name)}: resources.limits and requests must be maps")
        return result
    asked, ceiling = _asked(name, limits, requests, input_resources(active), result.errors)
    result.request = {k: show(v) for k, v in asked.items()}
    if ceiling:
        result.request[f"limits.{GPU}"] = show(limits[GPU])
    if result.errors or not asked:
        return result
    try:
        _read(result, asked, active, ceiling=ceiling, card=card, max_cards=max_cards, sized=sized)
    except RequestError as exc:
        result.errors.append(str(exc))
    return result


def _asked(
    name: str,
    limits: Mapping[str, Any],
    requests: Mapping[str, Any],
    mine: frozenset[str],
    errors: list[str],
) -> tuple[dict[str, Any], int]:
    """The GPU resources a container asks for, from its limits, and the ceiling a share may
    burst to (0: none) when its requests ask less ``fracgpu.io/gpu``; every other difference
    between the two is an error."""
    asked = {k: v for k, v in limits.items() if k in mine}
    ceiling = 0
    for key, value in requests.items():
        if key not in mine:
            continue
        if key not in limits:
            errors.append(
                f"{container_ref(name)}: {key} is set in requests ({show(value)}) but not in "
                f"limits; GPU resources are set in limits (requests may be omitted)"
            )
        elif value != limits[key] and not _same_quantity(value, limits[key]):
            if key == GPU:
                try:
                    ceiling = _burst(name, value, limits[key])
                    asked[key] = value  # the request is the guarantee
                except RequestError as exc:
                    errors.append(str(exc))
                continue
            errors.append(_differs(name, key, value, limits[key]))
    return asked, ceiling


def _differs(name: str, key: str, request: object, limit: object) -> str:
    return (
        f"{container_ref(name)}: {key} request {show(request)} differs from its limit "
        f"{show(limit)}; set only limits, or make requests equal to limits"
        + (
            f" (only {GPU} may ask less in requests than in limits: GPU memory is "
            f"never lent, since an allocation cannot be taken back)"
            if key in (GPUMEM, GPUMEM_PERCENTAGE)
            else ""
        )
    )


def _read(
    result: ContainerResult,
    asked: Mapping[str, Any],
    active: tuple[Dialect, ...],
    *,
    ceiling: int,
    card: CardChoice,
    max_cards: int,
    sized: bool,
) -> None:
    """What the container asked, and (``sized``) its grant, into ``result``; RequestError
    for the first problem."""
    name = result.name
    ask = parse_ask(name, asked, active)
    if ask is None:  # an explicit zero: no GPU
        result.request = {}
        result.zero = True
        return
    if ceiling:
        ask = replace(ask, ceiling=ceiling)
    result.ask = ask
    if ask.count > 1 and not sized:
        check_count(name, ask, max_cards)
    elif ask.count > 1:
        raise RequestError(several_cards_need_dra(name, ask))
    if sized:
        result.grant = resolve(name, ask, card, max_cards, result.warnings)


def _burst(name: str, request: object, limit: object) -> int:
    """A share's request below its limit: guaranteed the request, bursting to the limit into
    compute the card's other shares leave idle. The ceiling in hundredths; RequestError when
    the two do not make a share of one card that may burst."""
    rule = (
        f"{GPU} in requests is the share's guarantee and in limits the most it may burst to, "
        f"both shares of one card (0.01–1), the request below the limit"
    )
    guarantee = card_hundredths(name, GPU, request)
    ceiling = card_hundredths(name, GPU, limit)
    if guarantee is None or ceiling is None or guarantee > CORE_PER_CARD or ceiling > CORE_PER_CARD:
        raise RequestError(
            f"{container_ref(name)}: {GPU} request {show(request)} and limit {show(limit)}: "
            f"{rule}; whole cards are never throttled, so give them in limits alone"
        )
    if guarantee > ceiling:
        raise RequestError(
            f"{container_ref(name)}: {GPU} request {show(request)} is more than its limit "
            f"{show(limit)}: {rule}"
        )
    return ceiling


def _same_quantity(a: object, b: object) -> bool:
    try:
        return parse_quantity(a).value == parse_quantity(b).value
    except QuantityError:
        return a == b
