"""Health policy (which events mark a card) and the NVML thread against the fake NVML."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deviceplugin.shared import inventory
from deviceplugin.shared.health import EVENT_DBE, EVENT_XID, HealthMonitor
from deviceplugin.shared.inventory import Card
from deviceplugin.shared.settings import DEFAULT_IGNORED_XIDS
from testkit.gpunode import cards as fake_cards
from testkit.nvml import FakeNvml, build_cached

CARDS = [Card(i, f"GPU-{i}", "Fake", 4096, i, None) for i in range(2)]


def monitor(changes: list[tuple[int, bool, str]]) -> HealthMonitor:
    return HealthMonitor(
        CARDS,
        lambda card, ok, why: changes.append((card, ok, why)),
        ignored_xids=frozenset(DEFAULT_IGNORED_XIDS),
    )


@pytest.mark.parametrize(
    "xid", DEFAULT_IGNORED_XIDS, ids=[f"xid-{x}" for x in DEFAULT_IGNORED_XIDS]
)
def test_application_xids_are_ignored(xid: int) -> None:
    changes: list[tuple[int, bool, str]] = []
    monitor(changes).handle_event(0, EVENT_XID, xid)
    assert changes == []


def test_critical_xid_and_ecc_mark_the_card_once() -> None:
    changes: list[tuple[int, bool, str]] = []
    health = monitor(changes)
    health.handle_event(1, EVENT_XID, 79)
    health.handle_event(1, EVENT_XID, 48)
    health.handle_event(0, EVENT_DBE, 0)
    assert changes == [(1, False, "XID 79"), (0, False, "double-bit ECC error")]


def test_event_without_a_card_marks_every_card() -> None:
    changes: list[tuple[int, bool, str]] = []
    monitor(changes).handle_event(None, EVENT_XID, 62)
    assert sorted(c for c, _, _ in changes) == [0, 1]


def test_ignored_xids_are_configurable() -> None:
    changes: list[tuple[int, bool, str]] = []
    health = HealthMonitor(
        CARDS, lambda c, ok, why: changes.append((c, ok, why)), ignored_xids=frozenset({79})
    )
    health.handle_event(0, EVENT_XID, 79)
    health.handle_event(0, EVENT_XID, 13)
    assert changes == [(0, False, "XID 13")]


@pytest.fixture
def nvml(tmp_path: Path) -> Iterator[tuple[FakeNvml, list[Card]]]:
    fake = FakeNvml(tmp_path, fake_cards(2))
    os.environ.update(fake.env())
    inventory.load_nvml(build_cached())
    try:
        yield fake, inventory.discover()
    finally:
        inventory.shutdown_nvml()
        for key in fake.env():
            os.environ.pop(key, None)


def wait(predicate: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_thread_reports_event_and_recovers_after_quiet_period(
    nvml: tuple[FakeNvml, list[Card]],
) -> None:
    fake, cards = nvml
    changes: list[tuple[int, bool, str]] = []
    health = HealthMonitor(
        cards,
        lambda c, ok, why: changes.append((c, ok, why)),
        ignored_xids=frozenset(DEFAULT_IGNORED_XIDS),
        wait_ms=100,
        probe_interval_s=0.05,
        quiet_s=0.3,
    )
    health.start()
    try:
        time.sleep(0.1)
        fake.xid(0, 94)
        assert wait(lambda: changes[:1] == [(0, False, "XID 94")], 10.0)
        assert wait(lambda: len(changes) == 2, 10.0)
        assert changes[1][:2] == (0, True)
    finally:
        health.stop()


def test_thread_survives_nvml_errors(nvml: tuple[FakeNvml, list[Card]]) -> None:
    fake, cards = nvml
    changes: list[tuple[int, bool, str]] = []
    health = HealthMonitor(
        cards,
        lambda c, ok, why: changes.append((c, ok, why)),
        ignored_xids=frozenset({13}),
        wait_ms=50,
        probe_interval_s=0.05,
        quiet_s=60,
        error_backoff_s=0.01,
    )
    health.start()
    try:
        fake.fail_waits(5)
        fake.lose(1)
        assert wait(lambda: (1, False) in [(c, ok) for c, ok, _ in changes], 10.0)
        assert "GPU is lost" in changes[0][2]
        fake.xid(0, 13)
        fake.xid(0, 74)
        assert wait(lambda: (0, False, "XID 74") in changes, 10.0)
        assert health.running
        assert health.errors >= 5
    finally:
        health.stop()
