"""Inventory through pynvml, with the fake libnvidia-ml.so.1 in place of the driver's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deviceplugin.shared import inventory
from testkit.nvml import FakeCard, FakeNvml, build_cached


def test_discovers_cards_from_nvml(tmp_path: Path) -> None:
    fake = FakeNvml(
        tmp_path,
        [
            FakeCard("GPU-11111111-aaaa", 81920, 3, 1, "NVIDIA H100 80GB HBM3"),
            FakeCard("GPU-22222222-bbbb", 15360, 7, -1, "Tesla T4"),
        ],
    )
    os.environ.update(fake.env())
    try:
        inventory.load_nvml(build_cached())
        cards = inventory.discover()
    finally:
        inventory.shutdown_nvml()
    assert cards == [
        inventory.Card(0, "GPU-11111111-aaaa", "NVIDIA H100 80GB HBM3", 81920, 3, 1),
        inventory.Card(1, "GPU-22222222-bbbb", "Tesla T4", 15360, 7, None),
    ]


def test_unloadable_library_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "libnvidia-ml.so.1"
    with pytest.raises(inventory.InventoryError, match="cannot load NVML library"):
        inventory.load_nvml(missing)
