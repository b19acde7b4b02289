"""Compute share: kernel and graph launches are held to the percent in the limits file, measured
by the fake NVML against the fake driver's clock; 100 % is not throttled at all.

Tolerance: the hook's controller settles within a few 50 ms periods; over 3 s the card's
utilisation is expected within +-8 points of the target (the fake's kernels take 1 ms, so the
card can do 3000 in the window). The stated tolerance is deliberately wider than the ~2 points
observed, because the test shares a CPU with other work; for the same reason "not throttled" means
above 80 % busy (a starved launch loop can leave the card idle, a throttle would hold it near the
target)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fakes.native_kit import CUDA_SUCCESS, MIB, Kit, sanitized_kit

KERNEL_US = 1000
WINDOW_MS = 3000
TOLERANCE = 0.08


@pytest.fixture
def kit() -> Iterator[Kit]:
    k = sanitized_kit()
    k.reset()
    yield k
    k.reset()


def busy_fraction(kit: Kit, kind: str, percent: int | None) -> float:
    if percent is not None:
        kit.write_limits(1024 * MIB, percent)
    out = kit.probe(
        "init", f"launch:{WINDOW_MS}:{kind}", env={"FAKE_CUDA_KERNEL_US": str(KERNEL_US)}
    )
    rc, launches = out.one("launch")
    assert rc == CUDA_SUCCESS
    kernels_per_launch = 4 if kind == "graph" else 1  # FAKE_CUDA_GRAPH_KERNELS default
    return launches * kernels_per_launch * KERNEL_US / (WINDOW_MS * 1000)


@pytest.mark.parametrize("kind", ["kernel", "ex", "coop", "graph"])
def test_launches_run_at_the_compute_share(kit: Kit, kind: str) -> None:
    assert busy_fraction(kit, kind, 30) == pytest.approx(0.30, abs=TOLERANCE)


def test_a_small_share_is_held_too(kit: Kit) -> None:
    assert busy_fraction(kit, "kernel", 10) == pytest.approx(0.10, abs=TOLERANCE)


def test_a_whole_share_is_not_throttled(kit: Kit) -> None:
    assert busy_fraction(kit, "kernel", 100) > 0.8


def test_no_limits_file_is_not_throttled(kit: Kit) -> None:
    assert busy_fraction(kit, "kernel", None) > 0.8
