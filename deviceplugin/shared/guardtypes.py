"""What the node guard's pieces and the share meter hand each other: a container as its cgroup
names it, the fracgpu container and grant it resolves to, and one scan's reading.

This module is the bottom of the guard: it imports no other piece of it, so every piece and the
share meter (sharing.py) can name these types without importing the guard itself, and the
imports among them run one way (tests/test_layers_python.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core.contract import Limits
from deviceplugin.shared.inventory import Card


@dataclass(frozen=True, slots=True)
class ContainerRef:
    """A container as its cgroup names it."""

    pod_uid: str
    container_id: str


@dataclass(frozen=True, slots=True)
class Owner:
    """A fracgpu container and its grant (``grant``: the grant's limits directory, its key)."""

    namespace: str
    pod: str
    container: str
    pod_uid: str
    container_id: str
    limits: Limits
    grant: str = ""

    @property
    def name(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"

    def allowed(self, card_uuid: str) -> int:
        """Bytes this container may hold on the card (0 on a card it was not given)."""
        return self.limits.memory_bytes if card_uuid in self.limits.devices else 0


@dataclass(frozen=True, slots=True)
class Process:
    """One process on a card as a scan saw it; ``start`` makes the pid name this one process
    only, so that a kill decided on it cannot reach a pid reused since."""

    pid: int
    used: int  # bytes
    start: int  # stat field 22
    ref: ContainerRef | None = None  # its container (a grant may span several)


@dataclass(frozen=True, slots=True)
class Usage:
    """A grant's processes on one card (``owner``: the first of the grant's containers seen)."""

    owner: Owner
    card: Card
    processes: tuple[Process, ...]

    @property
    def used(self) -> int:
        return sum(p.used for p in self.processes)


@dataclass(slots=True)
class Observation:
    """One scan's reading: each grant's processes per card (``owner``: the first container of
    the grant seen; its name is what logs and Events point at)."""

    usage: list[Usage] = field(default_factory=list)
    foreign: dict[int, int] = field(default_factory=dict)  # card -> processes of no container
    unmeasured: dict[int, int] = field(default_factory=dict)  # card -> no per-process figure
    failed: set[int] = field(default_factory=set)  # cards whose lists NVML did not give
    # card -> pid -> percent of the card's SMs busy with it since the previous scan; a card
    # whose utilisation NVML does not sample (MIG, some models) is not here.
    busy: dict[int, dict[int, float]] = field(default_factory=dict)


__all__ = ["ContainerRef", "Observation", "Owner", "Process", "Usage"]
