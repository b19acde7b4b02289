"""Which GPU models exist and how much memory each has, for sizing requests at admission.

Percentages, default memory and memory-only shares need a card's memory, which only the
node knows (whole cards do not: they get all of whichever card they land on). The device
plugin labels each node (``fracgpu.io/gpu.product``, ``fracgpu.io/gpu.memory-mib``); NVIDIA
GPU Feature Discovery's ``nvidia.com/gpu.product`` and ``nvidia.com/gpu.memory`` are read too.
Without a cluster, models come from configuration.

A pod is sized for the model it is pinned to (``nodeSelector``, required node affinity, or
``nodeName``) or chooses in its annotations (``fracgpu.io/gpu-model``, ``-exclude``); an
unpinned pod in a mixed cluster is sized for the *smallest* candidate, so the grant fits
wherever the scheduler puts it (a memory-only request, for the smallest candidate that holds it).

Every admission asks for a choice, and a fleet has hundreds of nodes but a handful of models:
choices are computed once per placement (unpinned, or the products a pod pins) and kept until a
node's GPU labels really change. Node updates that leave the labels alone (status, heartbeats,
other labels) keep the cache.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from core.labels import LABEL_PAIRS, PRODUCT_LABEL, PRODUCT_LABELS, ModelSet, pinned_products
from webhook.gpumodels import CardChoice, GpuModel

_MAX_CHOICES = 256


@dataclass(frozen=True, slots=True)
class NodeCards:
    """What one node says about its cards: the product under each label key, and the memory."""

    products: Mapping[str, str]  # label key → product name
    memory_mib: int


def node_cards(labels: Mapping[str, Any]) -> NodeCards | None:
    for product_key, memory_key in LABEL_PAIRS:
        product, memory = labels.get(product_key), labels.get(memory_key)
        if isinstance(product, str) and product and isinstance(memory, str) and memory.isdigit():
            products = {
                key: labels[key]
                for key in PRODUCT_LABELS
                if isinstance(labels.get(key), str) and labels[key]
            }
            return NodeCards(products, int(memory))
    return None


class Inventory:
    """Known GPU models: static configuration plus what nodes report, kept current by a watch."""

    def __init__(self, static: Mapping[str, int] | None = None) -> None:
        self._static = {name: GpuModel(name, mib) for name, mib in (static or {}).items()}
        self._nodes: dict[str, NodeCards] = {}
        # placement (the pinned label key and products, or None; the models the pod chose, or
        # None) → choice
        self._choices: dict[tuple[tuple[str, frozenset[str]] | None, ModelSet | None], CardChoice]
        self._choices = {}

    def set_node(self, name: str, labels: Mapping[str, Any]) -> None:
        cards = node_cards(labels)
        if self._nodes.get(name) == cards:
            return
        if cards is None:
            del self._nodes[name]
        else:
            self._nodes[name] = cards
        self._choices.clear()

    def remove_node(self, name: str) -> None:
        if self._nodes.pop(name, None) is not None:
            self._choices.clear()

    def replace_nodes(self, nodes: Iterable[tuple[str, Mapping[str, Any]]]) -> None:
        self._nodes.clear()
        self._choices.clear()
        for name, labels in nodes:
            self.set_node(name, labels)

    def largest_card_mib(self, products: Container[str] | None) -> int | None:
        """Memory of the largest card a pod pinned to ``products`` (None: unpinned) may land
        on, or None when no such model is known: what whole cards are charged to a quota."""
        sizes = [
            card.memory_mib
            for card in self.models().values()
            if products is None or card.product in products
        ]
        return max(sizes, default=None)

    def models(self, label_key: str | None = None) -> dict[str, GpuModel]:
        """Known models by product name (under one label key's spelling, if given)."""
        found = dict(self._static)
        for cards in self._nodes.values():
            keys = [label_key] if label_key else list(cards.products)
            for key in keys:
                product = cards.products.get(key)
                if product is None:
                    continue
                known = found.get(product)
                # Nodes are the truth; take the smallest report in case drivers differ.
                if known is None or cards.memory_mib < known.memory_mib:
                    found[product] = GpuModel(product, cards.memory_mib)
        return found

    def choose(self, pod_spec: Mapping[str, Any], chosen: ModelSet | None = None) -> CardChoice:
        """The cards a pod may be sized against: its node's, else its pinned and chosen models."""
        node_name = pod_spec.get("nodeName")
        if isinstance(node_name, str) and node_name in self._nodes:
            cards = self._nodes[node_name]
            card = GpuModel(next(iter(cards.products.values())), cards.memory_mib)
            return CardChoice((card,))
        pinned = pinned_products(pod_spec)
        choice = self._choices.get((pinned, chosen))
        if choice is None:
            if len(self._choices) >= _MAX_CHOICES:  # pins are user input: keep the cache bounded
                self._choices.clear()
            choice = self._choices[pinned, chosen] = self._choose(pinned, chosen)
        return choice

    def _choose(
        self, pinned: tuple[str, frozenset[str]] | None, chosen: ModelSet | None
    ) -> CardChoice:
        if pinned is None:
            models = self.models()
            if chosen is None:
                return self._among(models, None)
            allowed = {p: card for p, card in models.items() if p in chosen}
            if not allowed:
                return CardChoice(
                    unknown="no GPU model the pod chooses in its annotations is known to fracgpu"
                )
            return self._among(allowed, None)
        key, products = pinned
        known = self.models(key)
        missing = sorted(p for p in products if p not in known)
        if missing and len(missing) == len(products):
            return CardChoice(
                unknown=f"the GPU model the pod selects ({key}={', '.join(missing)}) "
                f"is not known to fracgpu",
            )
        return self._among(
            {p: known[p] for p in products if p in known and (chosen is None or p in chosen)},
            key,
        )

    @staticmethod
    def _among(candidates: Mapping[str, GpuModel], key: str | None) -> CardChoice:
        ordered = sorted(candidates.values(), key=lambda c: (c.memory_mib, c.product))
        return CardChoice(tuple(ordered), key or PRODUCT_LABEL)
