"""Every container of a pod normalised, remembered across the replicas of a workload.

The replicas of a Job or Deployment arrive as a burst of pods with the same containers, and
normalising one (``webhook.resources``) is most of a mutation: ``ContainerNormaliser`` remembers
what each container normalised to, bounded by ``MEMO_SIZE``.
"""

from __future__ import annotations

from typing import Any

from webhook.config import AdmissionConfig
from webhook.dialects import Dialect, input_resources
from webhook.gpumodels import CardChoice
from webhook.podwalk import Located, containers
from webhook.resources import ContainerResult, normalise_container

# Normalised containers remembered; cleared when full.
MEMO_SIZE = 4096


class ContainerNormaliser:
    """``normalise_container`` with the admission configuration's dialects and bounds, each
    result remembered. ``sized``: device-plugin mode, where the grant is sized here (DRA mode
    sizes the claim per GPU model instead)."""

    def __init__(
        self, config: AdmissionConfig, dialects: tuple[Dialect, ...], *, sized: bool
    ) -> None:
        self.config = config
        self.dialects = dialects
        self.inputs = input_resources(dialects)
        self.sized = sized
        self._memo: dict[tuple[Any, ...], tuple[CardChoice, ContainerResult]] = {}

    def pod(
        self,
        spec: dict[str, Any],
        choice: CardChoice,
        errors: list[str],
        warnings: list[str],
    ) -> list[Located]:
        """Every container and init container of a pod spec, normalised; their problems added
        to ``errors`` and their warnings, each once, to ``warnings``."""
        results: list[Located] = []
        for list_name, index, container in containers(spec):
            name = str(container.get("name") or f"{list_name}[{index}]")
            result = self(name, container.get("resources"), choice)
            errors.extend(result.errors)
            for warning in result.warnings:
                if warning not in warnings:
                    warnings.append(warning)
            results.append((list_name, index, container, result))
        return results

    def __call__(self, name: str, resources: Any, choice: CardChoice) -> ContainerResult:
        """``normalise_container``, remembered.

        Only text values are remembered (the apiserver sends every quantity as text), so
        ``True``, ``1`` and ``1.0``, which hash alike but parse differently, never share an
        entry. The card choice is keyed by identity (the inventory hands out the same object
        until a node's cards change), and each entry holds its choice, so an identity is never
        reused while its entry lives. Results are shared between pods and never modified.
        """
        key = _memo_key(name, resources, self.inputs, id(choice))
        max_cards, sized = self.config.max_cards, self.sized
        if key is None:
            return normalise_container(
                name, resources, self.dialects, choice, max_cards, sized=sized
            )
        entry = self._memo.get(key)
        if entry is not None and entry[0] is choice:
            return entry[1]
        if len(self._memo) >= MEMO_SIZE:
            self._memo.clear()
        result = normalise_container(name, resources, self.dialects, choice, max_cards, sized=sized)
        self._memo[key] = (choice, result)
        return result


def _memo_key(
    name: str, resources: object, inputs: frozenset[str], choice_id: int
) -> tuple[Any, ...] | None:
    """What normalising a container depends on, or None when it cannot be remembered."""
    if not isinstance(resources, dict):
        return None if resources else (name, (), (), choice_id)
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    if not isinstance(limits, dict) or not isinstance(requests, dict):
        return None
    asked = tuple((k, v) for k, v in limits.items() if k in inputs)
    also = tuple((k, v) for k, v in requests.items() if k in inputs)
    for _, value in asked + also:
        if type(value) is not str:
            return None
    return (name, asked, also, choice_id)
