"""DRA plugin benchmark: ``python -m bench.dra [--pods N] [--wipes N]``.

On a fake 8-card node (8 x 80 GiB, fake NVML, no GPU needed), with the plugin in its own process
and its production settings, the fake API server in a thread of this process (real HTTP), and
the timed calls made from this process over real gRPC on the plugin's unix socket:

1. NodePrepareResources for pods with 1 and with 8 claims (one call per pod, as kubelet makes
   it), each claim a share (10 cores, 1 GiB) that the fake scheduler allocated just before:
   the plugin's GETs of the claims are inside the timing, and so are its limits files, CDI specs
   and the durable checkpoint write. Between pods (untimed) the claims are unprepared and deleted.
   Baseline, in the same rhythm and on the same server: NodePrepareResources naming no claim
   (the same gRPC path, no work).
2. ResourceSlice republish: from kubelet's wipe (the slice deleted on the API server) until the
   plugin's new slice is stored.

Targets: NodePrepareResources p99 < 20 ms (1 and 8 claims); republish < 2 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

from bench._api import ApiThread
from bench._config import agent_process, from_json
from bench._load import free_port
from bench.deviceplugin import cpu_times, steal_percent, summary
from deviceplugin._proto import dra_v1_pb2 as dra
from deviceplugin._proto import dra_v1_pb2_grpc as dra_grpc
from deviceplugin.dra.config import DraConfig
from testkit.dranode import DRIVER, NODE, device_class, share_claim
from testkit.draobjects import allocate_claim
from testkit.gpunode import GIB, cards
from testkit.nvml import FakeNvml, build_cached


def serve(text: str) -> int:
    """The plugin process of the benchmark: run the daemon until stdin closes."""
    from deviceplugin.dra.daemon import DraDaemon

    config = from_json(DraConfig, text)

    async def main() -> None:
        daemon = DraDaemon(config)
        await daemon.start()
        await asyncio.to_thread(sys.stdin.read)
        await daemon.stop()

    asyncio.run(main())
    return 0


@contextmanager
def plugin_process(config: DraConfig, nvml: FakeNvml) -> Iterator[None]:
    with agent_process("bench.dra", config, nvml.env()):
        yield


def _until(predicate: Callable[[], bool], timeout: float = 30.0, poll_s: float = 0.001) -> float:
    started = time.perf_counter()
    while not predicate():
        if time.perf_counter() - started > timeout:
            raise TimeoutError("condition not reached")
        time.sleep(poll_s)
    return time.perf_counter() - started


def _slices(api: ApiThread) -> list[dict[str, Any]]:
    return api.call(lambda: api.fake.objects("resourceslices"))


def _claims_for_pod(api: ApiThread, pod: int, count: int) -> list[dra.Claim]:
    def make() -> list[dra.Claim]:
        made = []
        for i in range(count):
            name = f"pod{pod}-gpu-{i}"
            api.fake.put(share_claim(name, cores=10, memory="1Gi"))
            claim = allocate_claim(api.fake.store, "default", name)
            made.append(dra.Claim(namespace="default", name=name, uid=claim["metadata"]["uid"]))
        return made

    return api.call(make)


def _delete(api: ApiThread, claims: list[dra.Claim]) -> None:
    def remove() -> None:
        for claim in claims:
            api.fake.remove("resourceclaims", claim.name, "default")

    api.call(remove)


def prepare_timings(
    api: ApiThread, stub: dra_grpc.DRAPluginStub, pods: int, per_pod: int
) -> tuple[list[float], list[float]]:
    timed, baseline = [], []
    for pod in range(pods):
        claims = _claims_for_pod(api, pod, per_pod)
        started = time.perf_counter()
        stub.NodePrepareResources(dra.NodePrepareResourcesRequest(), timeout=10)
        baseline.append(time.perf_counter() - started)
        started = time.perf_counter()
        response = stub.NodePrepareResources(
            dra.NodePrepareResourcesRequest(claims=claims), timeout=10
        )
        timed.append(time.perf_counter() - started)
        errors = [a.error for a in response.claims.values() if a.error]
        if errors or len(response.claims) != per_pod:
            raise RuntimeError(f"prepare failed: {errors[:2]}")
        answer = stub.NodeUnprepareResources(
            dra.NodeUnprepareResourcesRequest(claims=claims), timeout=10
        )
        if any(a.error for a in answer.claims.values()):
            raise RuntimeError("unprepare failed")
        _delete(api, claims)
    return timed, baseline


def republish_timings(api: ApiThread, wipes: int) -> list[float]:
    timed = []
    for _ in range(wipes):
        (current,) = _slices(api)
        started = time.perf_counter()
        name = current["metadata"]["name"]
        api.call(lambda: api.fake.remove("resourceslices", name))  # noqa: B023 - called at once
        _until(lambda: len(_slices(api)) == 1, timeout=10)
        timed.append(time.perf_counter() - started)
        time.sleep(0.2)  # let the plugin settle before the next wipe
    return timed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dra")
    parser.add_argument("--pods", type=int, default=200, help="pods per case")
    parser.add_argument("--wipes", type=int, default=20)
    parser.add_argument(
        "--host-root-on-tmpfs",
        action="store_true",
        help="keep the claims' limits directories and the checkpoint on /dev/shm too (to see "
        "what this machine's disk costs)",
    )
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        return serve(args.serve)
    root = Path(tempfile.mkdtemp(prefix="fb", dir="/tmp"))
    # The CDI directory is a tmpfs on most hosts (/var/run); the claims' limits directories and
    # the checkpoint stay on this machine's disk, as /var/lib is on a node.
    shm = Path("/dev/shm")
    cdi_root = Path(tempfile.mkdtemp(prefix="fb-cdi", dir=shm if shm.is_dir() else root))
    host_root = root / "host"
    kubelet_root = root / "kl"
    if args.host_root_on_tmpfs:
        host_root, kubelet_root = cdi_root / "host", cdi_root / "kl"
    api = ApiThread()
    try:
        api.call(lambda: api.fake.put({"apiVersion": "v1", "kind": "Node",
                                       "metadata": {"name": NODE}}))  # fmt: skip
        api.call(lambda: api.fake.put(device_class()))
        nvml = FakeNvml(root, cards(8, 80 * GIB))
        config = DraConfig(
            node_name=NODE,
            driver_name=DRIVER,
            kubeconfig=api.fake.kubeconfig(root / "kubeconfig"),
            kubelet_root=kubelet_root,
            cdi_root=cdi_root,
            host_root=host_root,
            nvml_library=build_cached(),
            metrics_address="127.0.0.1",
            metrics_port=free_port(),
        )
        with plugin_process(config, nvml):
            _until(lambda: config.service_socket.exists() and len(_slices(api)) == 1)
            with grpc.insecure_channel(f"unix://{config.service_socket}") as channel:
                stub = dra_grpc.DRAPluginStub(channel)
                prepare_timings(api, stub, 10, 1)  # warm-up: connections, first imports
                cpu_before = cpu_times()
                one, one_base = prepare_timings(api, stub, args.pods, 1)
                eight, eight_base = prepare_timings(api, stub, args.pods, 8)
                steal = steal_percent(cpu_before, cpu_times())
            wipes = republish_timings(api, args.wipes)
    finally:
        api.close()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(cdi_root, ignore_errors=True)
    stats = {
        "one": summary(one),
        "one_base": summary(one_base),
        "eight": summary(eight),
        "eight_base": summary(eight_base),
        "wipes": summary(wipes),
    }
    report = {
        "node": {
            "cards": 8,
            "card_memory_gib": 80,
            "cdi_dir": str(cdi_root.parent),
            "host_root_dir": str(
                host_root.parent.parent if args.host_root_on_tmpfs else root.parent
            ),
        },
        "timed_from": "grpcio (this process)",
        "cpu_steal_percent_during_prepares": steal,
        "prepare_1_claim_per_pod": stats["one"],
        "baseline_empty_prepare_(1-claim rhythm)": stats["one_base"],
        "1_claim_p99_vs_baseline_p99": round(
            stats["one"]["p99_ms"] / stats["one_base"]["p99_ms"], 1
        ),
        "prepare_8_claims_per_pod": stats["eight"],
        "baseline_empty_prepare_(8-claim rhythm)": stats["eight_base"],
        "8_claims_p99_vs_baseline_p99": round(
            stats["eight"]["p99_ms"] / stats["eight_base"]["p99_ms"], 1
        ),
        "slice_wipe_to_republished": {**stats["wipes"], "max_ms": round(max(wipes) * 1000, 3)},
        "targets_met": {
            "prepare_1_claim_p99_below_20ms": stats["one"]["p99_ms"] < 20,
            "prepare_8_claims_p99_below_20ms": stats["eight"]["p99_ms"] < 20,
            "republish_max_below_2s": max(wipes) < 2.0,
        },
    }
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
