"""Node guard benchmark: ``python -m bench.guard [--samples N] [--processes N]``.

The real plugin (daemon in this process, guard thread at its production defaults: a scan every
0.5 s, 1 s grace before the kill), the strict FakeKubelet with one admitted pod of 1 GiB on a fake
2-card node, the fake NVML reporting per-process memory, and real processes (``sleep``) placed in
the pod's container through a fake node /proc tree and kubelet's log links (testkit/nodeproc).

1. Excess -> reported and excess -> killed: from appending a figure over the grant to the fake
   NVML's event file until the guard's excess counter moves, and until the process is reaped
   with SIGKILL. Each sample starts at a random phase of the scan interval. Measured with the
   default grace (1 s) and with ``--guard-grace 0``.
2. Baseline, same run and same machine: the mechanical floor of that path, a loop in this
   process that reads the card's processes through pynvml until the new figure shows, then
   kills the process through the guard's own verified pidfd kill. The difference is what the
   scan interval and the grace add, by design.
3. One scan's cost with ``--processes`` GPU processes in the container (every process mapped
   to its container and grant): what the guard costs the plugin per pass.

Target: excess acted on (killed) within 2 s with the defaults.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import signal
import statistics
import time
from pathlib import Path
from tempfile import TemporaryDirectory

from prometheus_client import CollectorRegistry

from bench.deviceplugin import percentile
from deviceplugin.classic.config import Config
from deviceplugin.shared.guard import Guard
from deviceplugin.shared.guardkill import kill_verified
from deviceplugin.shared.guardmetrics import GuardMetrics
from deviceplugin.shared.guardowners import Owners, grant_from
from deviceplugin.shared.guardproc import ProcReader
from deviceplugin.shared.guardscan import card_processes
from deviceplugin.shared.guardtypes import ContainerRef
from deviceplugin.shared.settings import GuardSettings
from testkit.gpunode import GpuNode, cards, gpu_node
from testkit.kubelet import Container, Pod
from testkit.nodeproc import NodeProc, container

GRANT_BLOCKS = 4  # 1 GiB with 256 MiB blocks
OVER_MIB = 4096
TARGET_S = 2.0
CONFIG = Config()
WORKLOAD = container("bench", "guard-0", "main")
STRANGER = container("bench", "not-fracgpu", "main")


def stats(samples: list[float]) -> dict[str, float]:
    return {
        "n": len(samples),
        "p50_ms": round(statistics.median(samples) * 1000, 1),
        "p99_ms": round(percentile(samples, 0.99) * 1000, 1),
        "max_ms": round(max(samples) * 1000, 1),
    }


def excess_count(node: GpuNode) -> float:
    value = node.plugin.metrics.registry.get_sample_value(
        "fracgpu_device_plugin_guard_excess_total", {"card": "0"}
    )
    return 0.0 if value is None else value


def guarded(node: GpuNode, procs: NodeProc, samples: int) -> tuple[list[float], list[float]]:
    """(excess -> reported, excess -> killed) through the daemon's guard thread."""
    assert node.daemon is not None and node.daemon.services is not None
    assert node.daemon.services.guard is not None
    interval = node.daemon.services.guard.interval_s
    reported: list[float] = []
    killed: list[float] = []
    for _ in range(samples):
        child = procs.spawn()
        procs.enter(child.pid, WORKLOAD)
        node.nvml.process(0, child.pid, 512)
        time.sleep(random.uniform(interval, 2 * interval))  # seen within grant, random phase
        before = excess_count(node)
        started = time.perf_counter()
        node.nvml.process(0, child.pid, OVER_MIB)
        seen = None
        while child.poll() is None:
            if seen is None and excess_count(node) > before:
                seen = time.perf_counter()
            time.sleep(0.0005)
        done = time.perf_counter()
        if child.returncode != -signal.SIGKILL:
            raise RuntimeError(f"the process ended with {child.returncode}, not SIGKILL")
        reported.append((seen or done) - started)
        killed.append(done - started)
        node.nvml.exit(0, child.pid)
    return reported, killed


def floor(node: GpuNode, procs: NodeProc, samples: int) -> list[float]:
    """The same path without scan interval or grace (a pod the guard leaves alone)."""
    proc = ProcReader(procs.proc)
    card = node.plugin.cards[0]
    timed = []
    for _ in range(samples):
        child = procs.spawn()
        procs.enter(child.pid, STRANGER)
        start = proc.start_time(child.pid)
        assert start is not None
        started = time.perf_counter()
        node.nvml.process(0, child.pid, OVER_MIB)
        # Spin, not sleep: this floor is the time until NVML shows the figure, to the microsecond.
        while card_processes(card).get(child.pid) != OVER_MIB * 2**20:
            continue
        ref = ContainerRef(STRANGER.pod_uid, STRANGER.container_id)
        outcome = kill_verified(proc, child.pid, start, ref)
        child.wait()
        timed.append(time.perf_counter() - started)
        if outcome != "killed":
            raise RuntimeError(f"baseline kill: {outcome}")
        node.nvml.exit(0, child.pid)
    return timed


def scan_cost(node: GpuNode, procs: NodeProc, processes: int, scans: int) -> list[float]:
    children = [procs.spawn() for _ in range(processes)]
    for child in children:
        procs.enter(child.pid, WORKLOAD)
        node.nvml.process(0, child.pid, 1)
    owners = Owners(
        procs.logs,
        lambda: node.plugin.podresources.list({CONFIG.core_resource, CONFIG.memory_resource}),
        grant_from(node.plugin.grant_dir),
    )
    guard = Guard(
        node.plugin.cards.values(),
        owners,
        ProcReader(procs.proc),
        GuardMetrics(CollectorRegistry(), "fracgpu_device_plugin"),
    )
    if len(guard.scan_once().usage[0].processes) != processes:
        raise RuntimeError("the scan did not map every process to the container")
    timed = []
    for _ in range(scans):
        started = time.perf_counter()
        guard.scan_once()
        timed.append(time.perf_counter() - started)
    for child in children:
        node.nvml.exit(0, child.pid)
        child.kill()
        child.wait()
    return timed


def setup(node: GpuNode, procs: NodeProc) -> None:
    pod = Pod(
        WORKLOAD.namespace,
        WORKLOAD.pod,
        [
            Container(
                WORKLOAD.container, {CONFIG.core_resource: 50, CONFIG.memory_resource: GRANT_BLOCKS}
            )
        ],
    )
    node.kubelet.admit(pod)
    node.kubelet.start_container(pod, WORKLOAD.container)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.guard")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--processes", type=int, default=64, help="for the scan's cost")
    args = parser.parse_args(argv)
    quiet = logging.getLogger("deviceplugin")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # each kill logs a warning
    try:
        return _run(args)
    finally:
        quiet.setLevel(level)  # the tests call main() in their own process


def _run(args: argparse.Namespace) -> int:
    with TemporaryDirectory(prefix="fgguard") as tmp:
        procs = NodeProc(Path(tmp))
        try:
            with gpu_node(
                cards(2, 8192),
                guard=GuardSettings(proc_root=procs.proc, container_logs=procs.logs),
            ) as node:
                setup(node, procs)
                assert node.daemon is not None and node.daemon.services is not None
                guard = node.daemon.services.guard
                assert guard is not None
                defaults = {"interval_s": guard.interval_s, "grace_s": guard.grace_s}
                reported, killed = guarded(node, procs, args.samples)
                guard.grace_s = 0.0
                reported_now, killed_now = guarded(node, procs, args.samples)
                base = floor(node, procs, args.samples)
                scans = scan_cost(node, procs, args.processes, 200)
        finally:
            procs.close()
    killed_stats, base_stats = stats(killed), stats(base)
    report = {
        "guard": defaults,
        "excess_to_reported": stats(reported),
        "excess_to_killed": killed_stats,
        "excess_to_reported_grace_0": stats(reported_now),
        "excess_to_killed_grace_0": stats(killed_now),
        "baseline_nvml_read_and_kill": base_stats,
        # what the scan interval and the grace add to the floor (a ratio of the two says little)
        "killed_p99_minus_baseline_p99_ms": round(killed_stats["p99_ms"] - base_stats["p99_ms"], 1),
        f"scan_with_{args.processes}_processes": {
            "p50_ms": round(statistics.median(scans) * 1000, 3),
            "p99_ms": round(percentile(scans, 0.99) * 1000, 3),
        },
        "target_killed_within_s": TARGET_S,
        "met": killed_stats["max_ms"] <= TARGET_S * 1000,
    }
    print(json.dumps(report, indent=2))
    return 0  # a benchmark reports; it does not fail on a missed target


if __name__ == "__main__":
    raise SystemExit(main())
