"""deviceplugin/shared/guardtypes.py: what a container may hold of a card, and a grant's use."""

from __future__ import annotations

import pytest

from core.contract import Limits
from deviceplugin.shared.guardtypes import ContainerRef, Owner, Process, Usage
from deviceplugin.shared.inventory import Card

CARD = Card(0, "GPU-a", "NVIDIA L4", 23034, 0, None)
REF = ContainerRef("6f1c2a8e-1b2c-4d5e-8f90-0123456789ab", "0f" * 32)


def owner(devices: tuple[str, ...], memory: int = 1 << 30) -> Owner:
    return Owner("ns", "pod", "main", REF.pod_uid, REF.container_id, Limits(devices, memory, 50))


@pytest.mark.parametrize(
    ("devices", "card_uuid", "expected"),
    [
        pytest.param(("GPU-a",), "GPU-a", 1 << 30, id="its-card"),
        pytest.param(("GPU-a", "GPU-b"), "GPU-b", 1 << 30, id="each-of-its-cards"),
        pytest.param(("GPU-a",), "GPU-c", 0, id="a-card-it-was-not-given"),
    ],
)
def test_owner_allowed(devices: tuple[str, ...], card_uuid: str, expected: int) -> None:
    assert owner(devices).allowed(card_uuid) == expected


def test_owner_name_is_what_logs_and_events_show() -> None:
    assert owner(("GPU-a",)).name == "ns/pod/main"


@pytest.mark.parametrize(
    ("used", "expected"),
    [
        pytest.param((), 0, id="no-processes"),
        pytest.param((100,), 100, id="one"),
        pytest.param((100, 250, 5), 355, id="its-processes-together"),
    ],
)
def test_usage_used(used: tuple[int, ...], expected: int) -> None:
    processes = tuple(Process(pid, mine, 1, REF) for pid, mine in enumerate(used, start=10))
    assert Usage(owner(("GPU-a",)), CARD, processes).used == expected
