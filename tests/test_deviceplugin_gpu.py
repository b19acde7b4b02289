"""Inventory and health against the real NVML of a GPU machine; skipped without one.

Run on a GPU node: ``pytest -m gpu tests/test_deviceplugin_gpu.py -s`` (prints what NVML reported).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pynvml
import pytest

from deviceplugin import inventory
from deviceplugin.config import DEFAULT_IGNORED_XIDS
from deviceplugin.health import HealthMonitor
from deviceplugin.inventory import Card

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def real_cards() -> Iterator[list[Card]]:
    try:
        inventory.load_nvml(None)
    except inventory.InventoryError as exc:
        pytest.skip(f"no NVIDIA driver here: {exc}")
    try:
        driver = str(pynvml.nvmlSystemGetDriverVersion())
        if "fake" in driver:
            # pynvml loads its library once per process; the fake may already be it.
            pytest.skip("this process loaded the test's fake NVML; run the gpu tests alone")
        print({"driver": driver})
        cards = inventory.discover()
        if not cards:
            pytest.skip("NVML sees no GPU")
        yield cards
    finally:
        inventory.shutdown_nvml()


def test_inventory_from_real_nvml(real_cards: list[Card]) -> None:
    for card in real_cards:
        print(card.to_json())
        assert card.uuid.startswith(("GPU-", "MIG-"))
        assert card.memory_mib > 1024
        assert card.product
        assert card.numa_node is None or card.numa_node >= 0


def test_health_thread_runs_on_real_nvml(real_cards: list[Card]) -> None:
    changes: list[tuple[int, bool, str]] = []
    health = HealthMonitor(
        real_cards,
        lambda c, ok, why: changes.append((c, ok, why)),
        ignored_xids=frozenset(DEFAULT_IGNORED_XIDS),
        wait_ms=200,
        probe_interval_s=0.2,
    )
    health.start()
    try:
        time.sleep(1.5)
        assert health.running
        print({"changes": changes, "nvml_errors": health.errors})
        assert changes == []  # a healthy machine reports nothing
        supported = pynvml.nvmlDeviceGetSupportedEventTypes(pynvml.nvmlDeviceGetHandleByIndex(0))
        print({"supported_event_types": hex(supported)})
    finally:
        health.stop()
