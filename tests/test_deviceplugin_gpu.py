"""Inventory, health and the guard's process lists against real NVML; skipped without a GPU.

Run on a GPU node: ``pytest -m gpu tests/test_deviceplugin_gpu.py -s`` (prints what NVML reported).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pynvml
import pytest

from deviceplugin.classic.config import Config
from deviceplugin.shared import inventory
from deviceplugin.shared.guardscan import card_processes
from deviceplugin.shared.health import HealthMonitor
from deviceplugin.shared.inventory import Card
from deviceplugin.shared.settings import DEFAULT_IGNORED_XIDS

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


# A CUDA program in a child: a context on card 0 and 256 MiB allocated, then it waits.
CUDA_CHILD = """
import ctypes, time
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
device, context, pointer = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
assert cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
assert cuda.cuCtxCreate_v2(ctypes.byref(context), 0, device) == 0
assert cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(256 << 20)) == 0
print("ready", flush=True)
time.sleep(60)
"""


def test_guard_reads_a_cuda_process_and_its_context_fits_the_allowance(
    real_cards: list[Card],
) -> None:
    child = subprocess.Popen([sys.executable, "-c", CUDA_CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        used = None
        deadline = time.monotonic() + 10
        while used is None and time.monotonic() < deadline:
            used = card_processes(real_cards[0]).get(child.pid)
            time.sleep(0.1)
        assert used is not None, "NVML does not list the process (vGPU? another PID namespace?)"
        context_mib = (used >> 20) - 256
        print({"pid": child.pid, "used_mib": used >> 20, "context_mib": context_mib})
        assert used >= 256 << 20
        allowance = Config().guard.process_overhead_mib
        assert context_mib <= allowance, (
            f"a bare CUDA context takes {context_mib} MiB here, more than the guard's default "
            f"allowance of {allowance} MiB (--guard-process-overhead-mib): raise the default"
        )
    finally:
        child.kill()
        child.wait()


def test_a_shares_use_is_exported_from_real_nvml(real_cards: list[Card]) -> None:
    """The per-share gauges from a real card: a CUDA process of a (stand-in) container shows as
    its share's memory used, NVML's own figure, beside the grant it was given."""
    from prometheus_client import CollectorRegistry

    from core.contract import Limits
    from deviceplugin.shared.guard import Guard
    from deviceplugin.shared.guardmetrics import GuardMetrics
    from deviceplugin.shared.guardtypes import ContainerRef, Owner

    card = real_cards[0]
    child = subprocess.Popen([sys.executable, "-c", CUDA_CHILD], stdout=subprocess.PIPE, text=True)
    ref = ContainerRef("6f1c2a8e-1b2c-4d5e-8f90-0123456789ab", "0f" * 32)
    owner = Owner("team-a", "train-0", "main", ref.pod_uid, ref.container_id,
                  Limits((card.uuid,), 4 << 30, 30), grant="g")  # fmt: skip

    class OneContainer:
        """The child's process is the container's; the rest of the node's are not."""

        def container(self, pid: int) -> ContainerRef | None:
            return ref if pid == child.pid else None

        def start_time(self, pid: int) -> int | None:
            return 1

    class Resolve:
        def resolve(self, seen: ContainerRef) -> Owner | None:
            return owner if seen == ref else None

        def forget_idle(self) -> None:
            return None

    metrics = GuardMetrics(CollectorRegistry(), "fracgpu_device_plugin")
    guard = Guard([card], Resolve(), OneContainer(), metrics, kill=False)  # type: ignore[arg-type]
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        labels = {"namespace": "team-a", "pod": "train-0", "container": "main",
                  "card_uuid": card.uuid, "model": card.product}  # fmt: skip
        used = None
        deadline = time.monotonic() + 10
        while used is None and time.monotonic() < deadline:
            guard.scan_once()
            used = metrics.registry.get_sample_value(
                "fracgpu_device_plugin_share_memory_used_bytes", labels
            )
            time.sleep(0.1)
        print({"share_memory_used_mib": None if used is None else int(used) >> 20})
        assert used is not None, "the scan exported no share for the CUDA process"
        assert used >= 256 << 20
        granted = metrics.registry.get_sample_value(
            "fracgpu_device_plugin_share_memory_granted_bytes", labels
        )
        assert granted == 4 << 30
        # Compute used: NVML's per-process samples (the child is idle: no sample, 0). A card
        # that does not sample per process exports no series; data-centre cards do.
        busy = metrics.registry.get_sample_value(
            "fracgpu_device_plugin_share_compute_used_percent", labels
        )
        print({"share_compute_used_percent": busy})
        assert busy is not None, "NVML gave no per-process utilisation for this card"
        assert 0 <= busy <= 100
    finally:
        child.kill()
        child.wait()
