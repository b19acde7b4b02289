"""Device IDs: the only thing kubelet tells the plugin about an allocation, so they name the card.

Scheme (at most 12 characters, far below kubelet's 63):

    g<card index>-c<n>   one hundredth of card <index>'s compute,   n = 0..99
    g<card index>-m<n>   one memory block (256 MiB) of card <index>, n = 0..blocks-1

The card index is NVML's index on this node (PCI order), which is stable while the node's set
of cards is unchanged; the checkpoint also records each card's UUID, so a node whose cards changed
under live allocations is detected rather than silently mis-mapped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache

MAX_ID_LENGTH = 63


class Kind(StrEnum):
    CORE = "c"
    MEMORY = "m"


_ID = re.compile(r"g(0|[1-9][0-9]{0,3})-([cm])(0|[1-9][0-9]{0,6})")


class DeviceIdError(ValueError):
    """A device ID that this plugin never advertised."""


@dataclass(frozen=True, slots=True, order=True)
class DeviceId:
    card: int
    kind: Kind
    number: int

    def __str__(self) -> str:
        return f"g{self.card}-{self.kind.value}{self.number}"

    @classmethod
    def parse(cls, text: str) -> DeviceId:
        return _parse(text)

    @classmethod
    def _parse_uncached(cls, text: str) -> DeviceId:
        match = _ID.fullmatch(text)
        if match is None:
            raise DeviceIdError(
                f"device ID {text[:70]!r} is not a fracgpu ID "
                f"(expected g<card>-c<n> or g<card>-m<n>)"
            )
        return cls(int(match[1]), Kind(match[2]), int(match[3]))


# Every list, preference and Allocate parses the same few thousand IDs of this node again.
@lru_cache(maxsize=65536)
def _parse(text: str) -> DeviceId:
    return DeviceId._parse_uncached(text)


def core_id(card: int, number: int) -> str:
    return str(DeviceId(card, Kind.CORE, number))


def memory_id(card: int, number: int) -> str:
    return str(DeviceId(card, Kind.MEMORY, number))
