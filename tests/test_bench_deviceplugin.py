"""The device plugin benchmark's drivers: both time the same RPCs, and errors are not timings.

Timings themselves are the benchmark's business (``python -m bench.deviceplugin``); these tests
only check that each driver makes the calls it is asked for, in order, against a real plugin.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import deviceplugin as bench
from testkit.gpunode import GIB, GpuNode, cards, gpu_node
from testkit.kubelet import Container, Pod


def go_driver() -> Path:
    try:
        return bench.build_go_driver()
    except RuntimeError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def node() -> Iterator[GpuNode]:
    with gpu_node(cards(2, 8 * GIB)) as running:
        assert running.wait_registered()
        yield running


@pytest.fixture(params=["python", "go"])
def driver(request: pytest.FixtureRequest, node: GpuNode) -> Iterator[bench.Driver]:
    made: bench.Driver = (
        bench.PythonDriver(node) if request.param == "python" else bench.GoDriver(go_driver(), node)
    )
    yield made
    made.close()


def test_a_container_is_allocated_and_started_through_the_driver(
    node: GpuNode, driver: bench.Driver
) -> None:
    pod = Pod("bench", "p", [Container("c", {bench.CORE: 30, bench.MEMORY: 8})])
    held = node.kubelet.admit(pod)["c"]  # kubelet's choice and Allocate, from the fake
    both = (bench.CORE, bench.MEMORY)
    steps = [
        *(bench.allocate_step(name, held[name]) for name in both),
        0.001,
        *(bench.prestart_step(name, held[name]) for name in both),
    ]
    took = driver.run(steps)
    assert len(took) == 4
    assert all(0 < t < 30 for t in took)
    (allocation,) = node.plugin.allocator.allocations()
    assert allocation.verified
    assert set(allocation.core) == set(held[bench.CORE])


def test_an_rpc_error_stops_the_run_instead_of_becoming_a_timing(
    node: GpuNode, driver: bench.Driver
) -> None:
    with pytest.raises(RuntimeError, match=r"Allocate: .*g7-c0"):
        driver.run([bench.allocate_step(bench.CORE, ["g7-c0"])])


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        pytest.param([0] * 8, [10, 0, 10, 70, 0, 0, 0, 10], 10.0, id="steal-10-of-100"),
        # no time passed: no division by zero
        pytest.param([5] * 8, [5] * 8, 0.0, id="no-time-passed"),
        pytest.param([], [1] * 8, None, id="no-proc-stat"),
    ],
)
def test_steal_share(before: list[int], after: list[int], expected: float | None) -> None:
    assert bench.steal_percent(before, after) == expected


def test_node_allocatable_lag_is_measured_against_the_fake_api_server() -> None:
    """The part of the benchmark that times what the scheduler sees: it runs and returns one
    figure per change and per direct patch (their size is the benchmark's business)."""
    lags, direct = bench.node_allocatable_lag(2)
    assert len(lags) == 2
    assert len(direct) == 2
