"""What a pod's DRA claims of the fracgpu DeviceClass charge to a GPU quota.

In DRA mode (design §9) a GPU pod carries no ``fracgpu.io/core``: its containers name pod-level
claims, each made from a ResourceClaimTemplate or naming a ResourceClaim, and the claim's device
requests say how much of a card each wants. Quota counts those requests in the same units as
device-plugin mode, whoever wrote them (the webhook's templates, or a user's own claims of the
class), so the same GPUQuota and the same denials apply in both modes:

* a request with ``capacity.requests`` charges ``count`` × its ``cores`` and ``memory``;
* a request with no capacity takes whole cards (the slice's defaults are the whole card):
  ``count`` × 100 hundredths and the memory of the largest card it may land on;
* ``firstAvailable`` charges the largest of its alternatives (any of them may be allocated: the
  quota must hold whichever it is);
* ``allocationMode: All`` takes every matching card of the node it lands on: it charges the
  most fracgpu cards any node publishes (the cluster's ResourceSlices), or, while no node
  publishes any, the most cards one container can be given (``MAX_DEVICES``), since a node that
  joins later may have that many.

A claim is counted once per pod however many containers share it. Template and claim specs are
immutable, so they are read once and remembered (bounded).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from core import dra
from core.contract import MAX_DEVICES
from core.kube import RESOURCE_CLAIM_TEMPLATES, RESOURCE_CLAIMS, Api, KubeNotFound, call_json
from core.quantity import quantity_int
from core.units import BLOCK_MIB, CORE_PER_CARD, MIB, card_blocks, ceil_div

_CACHE_SIZE = 4096
TEMPLATE, CLAIM = "template", "claim"
Ref = tuple[str, str, str]  # (namespace, TEMPLATE or CLAIM, name)
Planned = Callable[[str, str], Mapping[str, Any] | None]  # (namespace, template) -> claim spec
MostCards = Callable[[], int | None]  # the most fracgpu cards one node has (None: no node known)


@dataclass(frozen=True, slots=True)
class ClaimCharge:
    """What a pod's fracgpu claims hold: hundredths of a card, 256 MiB blocks, whole cards whose
    memory no known card could size, and claims that could not be read."""

    core: int = 0
    blocks: int = 0
    unsized_cards: int = 0
    missing: tuple[str, ...] = ()


def claim_refs(pod: Mapping[str, Any]) -> list[Ref]:
    """The claims a pod's containers use, as (namespace, kind, name), each once."""
    spec = pod.get("spec") if isinstance(pod.get("spec"), Mapping) else {}
    assert isinstance(spec, Mapping)
    meta = pod.get("metadata") if isinstance(pod.get("metadata"), Mapping) else {}
    assert isinstance(meta, Mapping)
    namespace = str(meta.get("namespace") or "")
    entries = spec.get("resourceClaims")
    by_name = {
        str(e.get("name")): e
        for e in (entries if isinstance(entries, list) else ())
        if isinstance(e, Mapping)
    }
    used: list[str] = []
    for key in ("initContainers", "containers"):
        containers = spec.get(key)
        for container in containers if isinstance(containers, list) else ():
            resources = container.get("resources") if isinstance(container, Mapping) else None
            claims = resources.get("claims") if isinstance(resources, Mapping) else None
            for claim in claims if isinstance(claims, list) else ():
                name = str(claim.get("name")) if isinstance(claim, Mapping) else ""
                if name in by_name and name not in used:
                    used.append(name)
    refs: list[Ref] = []
    for name in used:
        entry = by_name[name]
        if entry.get("resourceClaimTemplateName"):
            refs.append((namespace, TEMPLATE, str(entry["resourceClaimTemplateName"])))
        elif entry.get("resourceClaimName"):
            refs.append((namespace, CLAIM, str(entry["resourceClaimName"])))
    return refs


def _option_charge(
    option: Mapping[str, Any], card_mib: int | None, most_cards: int | None
) -> tuple[int, int, int]:
    """(hundredths, blocks, unsized cards) of one exact request or alternative."""
    raw = option.get("count")
    count = raw if isinstance(raw, int) else 1
    if option.get("allocationMode") == "All":
        count = MAX_DEVICES if most_cards is None else most_cards
    wanted = (option.get("capacity") or {}).get("requests") or {}
    if not wanted:
        if card_mib is None:
            return count * CORE_PER_CARD, 0, count
        return count * CORE_PER_CARD, count * card_blocks(card_mib), 0
    cores = quantity_int(wanted.get(dra.CORES))
    memory = quantity_int(wanted.get(dra.MEMORY))
    core = CORE_PER_CARD if cores is None else min(max(cores, 1), CORE_PER_CARD)
    if memory is None:  # the slice's default: the whole card's memory
        if card_mib is None:
            return count * core, 0, count
        return count * core, count * card_blocks(card_mib), 0
    return count * core, count * ceil_div(memory, BLOCK_MIB * MIB), 0


def charge_of(
    specs: Iterable[Mapping[str, Any]], card_mib: int | None, most_cards: int | None = None
) -> ClaimCharge:
    """The charge of claim specs (a ResourceClaim's ``spec``, or a template's ``spec.spec``);
    ``most_cards``: the most fracgpu cards one node has, for ``allocationMode: All``."""
    core = blocks = unsized = 0
    for spec in specs:
        for request in (spec.get("devices") or {}).get("requests") or []:
            options = (
                [request["exactly"]]
                if "exactly" in request
                else list(request.get("firstAvailable") or [])
            )
            ours = [o for o in options if o.get("deviceClassName") == dra.DEVICE_CLASS]
            if not ours:
                continue
            charges = [_option_charge(o, card_mib, most_cards) for o in ours]
            core += max(c[0] for c in charges)
            blocks += max(c[1] for c in charges)
            unsized += max(c[2] for c in charges)
    return ClaimCharge(core, blocks, unsized)


class ClaimSpecs:
    """Claim and template specs by reference, read from the API server and remembered."""

    def __init__(
        self,
        api: Api | None,
        *,
        request_timeout_s: float = 2.0,
        planned: Planned | None = None,
        most_cards: MostCards | None = None,
    ) -> None:
        self.api = api
        self.request_timeout_s = request_timeout_s
        # Templates admission planned in this process but did not make (a dry run makes none).
        self.planned = planned
        self.most_cards = most_cards
        self._specs: dict[Ref, Mapping[str, Any] | None] = {}

    def get(self, ref: Ref) -> Mapping[str, Any] | None:
        return self._specs.get(ref)

    def known(self, ref: Ref) -> bool:
        return ref in self._specs

    async def load(self, refs: Iterable[Ref]) -> None:
        """Read the specs not yet known (a missing object is remembered as None until asked
        again: a claim a user creates after the pod is read on the next admission)."""
        for ref in refs:
            if self._specs.get(ref) is not None or self.api is None:
                continue
            namespace, kind, name = ref
            resource = RESOURCE_CLAIM_TEMPLATES if kind == TEMPLATE else RESOURCE_CLAIMS
            try:
                obj = await call_json(
                    self.api,
                    "GET",
                    resource.path(namespace, name),
                    timeout_s=self.request_timeout_s,
                )
            except KubeNotFound:
                known = self.planned(namespace, name) if kind == TEMPLATE and self.planned else None
                self._specs[ref] = None if known is None else known
                continue
            spec = obj.get("spec") or {}
            if kind == TEMPLATE:
                spec = spec.get("spec") or {}
            if len(self._specs) >= _CACHE_SIZE:
                self._specs.clear()
            self._specs[ref] = spec

    def charge(self, pod: Mapping[str, Any], card_mib: int | None) -> ClaimCharge | None:
        """What the pod's claims hold, from specs already loaded; None when it uses none."""
        refs = claim_refs(pod)
        if not refs:
            return None
        specs = [spec for ref in refs if (spec := self._specs.get(ref)) is not None]
        missing = tuple(f"{ref[1]} {ref[2]}" for ref in refs if self._specs.get(ref) is None)
        found = charge_of(specs, card_mib, self.most_cards() if self.most_cards else None)
        return ClaimCharge(found.core, found.blocks, found.unsized_cards, missing)
