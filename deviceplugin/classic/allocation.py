"""One container's record: the device IDs kubelet gave it and the card(s) the plugin placed it on.

The IDs identify the container (they are exclusive on a node) but name no card (see
``placement``); the cards are the plugin's own choice, made once both of the container's amounts
are known. The record is what the checkpoint stores and what PreStartContainer looks up.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from core.units import CORE_PER_CARD


class AllocationError(ValueError):
    """A request that can never work on this node (Allocate fails the pod; it is final)."""


def container_dir_name(core_ids: Iterable[str]) -> str:
    """Name of a container's host directory, derived from its core device IDs.

    Allocate (which sees only the core IDs) and PreStartContainer (which finds them through
    PodResources) compute the same name, and device IDs are exclusive on a node, so two
    containers never share a directory, however alike their requests are.
    """
    digest = hashlib.sha256(",".join(sorted(core_ids)).encode()).hexdigest()
    return f"c-{digest[:32]}"


@dataclass(slots=True)
class Allocation:
    core: tuple[str, ...]
    memory: tuple[str, ...]
    cards: tuple[int, ...]  # where the plugin placed it; () while it is not placed
    created: float  # wall-clock seconds; ADOPTED for a container learnt from a listing
    key: str = field(default_factory=lambda: uuid.uuid4().hex)
    # PodResources confirmed that one container holds exactly these core and memory IDs
    verified: bool = False
    # Extender placement only (``directed``): None until its pod's placement record was read;
    # then the card(s) the record names, or () for a pod without one (best fit). Read again
    # after a restart (the record is on the pod), so the checkpoint does not keep it.
    directed: tuple[int, ...] | None = None

    @property
    def dir_name(self) -> str | None:
        return container_dir_name(self.core) if self.core else None

    def ids(self) -> set[str]:
        return {*self.core, *self.memory}

    @property
    def whole_cards(self) -> int:
        """How many whole cards the container asks for (core in hundreds); 0 for a share."""
        n = len(self.core)
        return n // CORE_PER_CARD if n and n % CORE_PER_CARD == 0 else 0

    @property
    def whole_cards_only(self) -> bool:
        """Whole cards admitted without memory: all of each card is theirs."""
        return bool(self.whole_cards) and not self.memory

    @property
    def placeable(self) -> bool:
        """Both amounts known and valid: whole cards, or a share with core and memory."""
        return bool(self.whole_cards) or (0 < len(self.core) < CORE_PER_CARD and bool(self.memory))

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "core": list(self.core),
            "memory": list(self.memory),
            "cards": list(self.cards),
            "created": self.created,
            "verified": self.verified,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Allocation:
        """Raises KeyError, TypeError or ValueError for a record of another shape."""
        core, memory = data["core"], data["memory"]
        if not isinstance(core, list) or not isinstance(memory, list):
            raise TypeError("core and memory must be lists of device IDs")
        return cls(
            core=tuple(_text(i) for i in core),
            memory=tuple(_text(i) for i in memory),
            cards=tuple(int(c) for c in data["cards"]),
            created=float(data["created"]),
            key=str(data["key"]),
            verified=bool(data.get("verified", False)),
        )


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"device ID {value!r} is not a string")
    return value
