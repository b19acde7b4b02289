"""What a ResourceClaim grants on this node: the cards and the share of each, from its allocation.

kubelet names a claim (namespace, name, UID) and nothing else; the allocation the scheduler made
is read from the API server. Only this driver's results count (a claim may also hold other
drivers' devices). Each result names a device of this node's pool and what it consumed of the
card's ``cores`` and ``memory``; all results of one claim must consume the same share, because
the limits file holds one memory limit and one compute share for all of its cards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.contract import Limits, LimitsError
from core.policy import HARD_CAP, OPAQUE_API_VERSION, OPAQUE_KIND, PolicyError, SharePolicy
from core.quantity import QuantityError, parse_quantity
from core.units import CORE_PER_CARD, MIB
from deviceplugin.dra.slices import CORES, MEMORY, card_index
from deviceplugin.shared.inventory import Card


class ClaimError(ValueError):
    """A claim this plugin cannot prepare; the message goes back to kubelet and the pod's events."""


@dataclass(frozen=True, slots=True)
class Result:
    """One allocated device of this driver."""

    request: str  # the base request name (subrequests stripped, as kubelet wants)
    pool: str
    device: str
    share_id: str | None
    card: Card
    cores: int
    memory_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "request": self.request,
            "pool": self.pool,
            "device": self.device,
            "shareID": self.share_id,
            "uuid": self.card.uuid,
            "cores": self.cores,
            "memoryBytes": self.memory_bytes,
        }


@dataclass(frozen=True, slots=True)
class ClaimRef:
    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"ResourceClaim {self.namespace}/{self.name} (uid {self.uid})"


def _amount(ref: ClaimRef, device: str, name: str, raw: Any) -> int:
    try:
        quantity = parse_quantity(raw)
    except QuantityError:
        raise ClaimError(
            f"{ref}: device {device} consumed {name} {raw!r}, which is not a quantity"
        ) from None
    if not quantity.is_integer or quantity.value <= 0:
        raise ClaimError(
            f"{ref}: device {device} consumed {name} {raw!r}; it must be a positive whole number"
        )
    return int(quantity.value)


def results(
    ref: ClaimRef, claim: dict[str, Any], *, driver: str, pool: str, cards: dict[int, Card]
) -> list[Result]:
    """This driver's results of an allocated claim, checked against this node's cards.

    Raises ClaimError for a claim that is not this one (UID), not allocated, allocated on
    another node's pool, or names a device this node does not have.
    """
    meta = claim.get("metadata") or {}
    if meta.get("uid") != ref.uid:
        raise ClaimError(
            f"{ref}: the API server has uid {meta.get('uid')!r} under that name; the claim was "
            "replaced, and kubelet must prepare the new one"
        )
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(f"{ref}: not allocated yet (status.allocation is empty)")
    out: list[Result] = []
    for entry in (allocation.get("devices") or {}).get("results") or []:
        if entry.get("driver") != driver:
            continue
        device = str(entry.get("device") or "")
        if entry.get("pool") != pool:
            raise ClaimError(
                f"{ref}: device {device} was allocated from pool {entry.get('pool')!r}, but this "
                f"node's pool is {pool!r}"
            )
        index = card_index(device)
        card = cards.get(index) if index is not None else None
        if card is None:
            raise ClaimError(
                f"{ref}: device {device!r} is not a card of node {pool} "
                f"(it has {', '.join(f'gpu-{i}' for i in sorted(cards)) or 'none'}); "
                "was a card removed after the claim was allocated?"
            )
        consumed = entry.get("consumedCapacity") or {}
        # Without consumedCapacity the device was allocated whole (the policy defaults).
        cores = _amount(ref, device, CORES, consumed.get(CORES, CORE_PER_CARD))
        memory = _amount(ref, device, MEMORY, consumed.get(MEMORY, card.memory_mib * MIB))
        if cores > CORE_PER_CARD:
            raise ClaimError(
                f"{ref}: device {device} consumed {cores} cores; a card has {CORE_PER_CARD}"
            )
        share = entry.get("shareID")
        out.append(
            Result(
                request=str(entry.get("request") or "").split("/", 1)[0],
                pool=pool,
                device=device,
                share_id=str(share) if share else None,
                card=card,
                cores=cores,
                memory_bytes=memory,
            )
        )
    if not out:
        raise ClaimError(f"{ref}: its allocation has no device of driver {driver}")
    return out


def policy(ref: ClaimRef, claim: dict[str, Any], *, driver: str) -> SharePolicy:
    """The claim's compute policy: admission puts it in the claim's opaque configuration for
    this driver (core/policy.py); a claim without one is a hard cap. ClaimError for a
    configuration of this driver that is not a policy, or more than one."""
    found: list[object] = []
    for entry in ((claim.get("spec") or {}).get("devices") or {}).get("config") or []:
        opaque = entry.get("opaque") if isinstance(entry, dict) else None
        if isinstance(opaque, dict) and opaque.get("driver") == driver:
            found.append(opaque.get("parameters"))
    if not found:
        return HARD_CAP
    if len(found) > 1:
        raise ClaimError(
            f"{ref}: it has {len(found)} configurations for driver {driver}; a fracgpu claim has "
            "at most one (its share's compute policy)"
        )
    try:
        return SharePolicy.from_opaque(found[0])
    except PolicyError as exc:
        raise ClaimError(
            f"{ref}: its configuration for driver {driver} is not a compute policy: {exc}; "
            f"write apiVersion {OPAQUE_API_VERSION}, kind {OPAQUE_KIND}, and ceiling (percent "
            "of a card) and priority (high or low)"
        ) from None


def limits(ref: ClaimRef, granted: list[Result]) -> Limits:
    """The limits file of a claim: its cards, and the one share each of them holds."""
    shares = {(r.cores, r.memory_bytes) for r in granted}
    if len(shares) != 1:
        listed = ", ".join(f"{r.device}: {r.cores} cores, {r.memory_bytes} bytes" for r in granted)
        raise ClaimError(
            f"{ref}: its devices consumed different shares ({listed}); a fracgpu claim holds "
            "the same cores and memory on every card, so request them in one request"
        )
    cores, memory = shares.pop()
    uuids = tuple(dict.fromkeys(r.card.uuid for r in granted))
    if len(uuids) != len(granted):
        raise ClaimError(
            f"{ref}: it holds card {granted[0].card.uuid} more than once; a fracgpu claim holds "
            "each card once"
        )
    try:
        return Limits(uuids, memory, cores)
    except LimitsError as exc:
        raise ClaimError(f"{ref}: {exc}") from None
