"""Benchmark: GPU pod admission with a GPUQuota against the same burst without one.

    python -m bench.quota [--pods 2000] [--concurrency 64] [--replicas 2]

Everything runs in one process, in one run, on this machine: the fake API server
(tests/fakes, real HTTP), webhook replicas (the real admission server and quota service,
each with its own kubernetes-asyncio client) and a client that sends AdmissionReviews for a
same-namespace burst of GPU pods. Scenario "no quota": the namespace has no GPUQuota (the
reviewer still lists quotas to find that out). Scenario "quota": one GPUQuota sized to admit
90 % of the burst, so every pod is checked and reserved and the last tenth is denied.
Reported: admissions/s, p50/p99 latency per review, the quota/no-quota ratio, and the
over-admission check (admitted pods, reserved cards vs limit).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from quota.config import QuotaConfig
from quota.service import open_quota
from tests.fakes.apiserver import FakeApiServer
from tests.quota_pods import gpu_pod, gpu_quota, review
from webhook.server import build_app

CORE, BLOCKS = 10, 4  # each pod: 0.10 card, 1024 MiB


async def _replicas(stack: AsyncExitStack, fake: FakeApiServer, count: int) -> list[str]:
    """Webhook replicas; each also runs the quota service (the elected one reconciles)."""
    urls = []
    for index in range(count):
        api = await stack.enter_async_context(fake.api_client())
        config = QuotaConfig(
            timeout_s=30,
            request_timeout_s=10,
            resync_s=5,
            leader_election={"identity": f"replica-{index}", "lease_namespace": "default"},
        )
        service = await open_quota(config, api)
        stack.push_async_callback(service.close)
        task = asyncio.create_task(service.run())
        stack.callback(task.cancel)
        server = TestServer(build_app({"/validate": service.reviewer}))
        await server.start_server()
        stack.push_async_callback(server.close)
        urls.append(str(server.make_url("/validate")))
    return urls


async def _burst(
    fake: FakeApiServer,
    session: aiohttp.ClientSession,
    urls: list[str],
    namespace: str,
    *,
    pods: int,
    concurrency: int,
) -> dict[str, Any]:
    manifests = [gpu_pod(f"p{i}", CORE, BLOCKS, namespace=namespace) for i in range(pods)]
    bodies = [
        {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": review(pod)}
        for pod in manifests
    ]
    latencies: list[float] = []
    allowed = 0
    gate = asyncio.Semaphore(concurrency)

    async def one(index: int) -> None:
        nonlocal allowed
        async with gate:
            started = time.perf_counter()
            async with session.post(urls[index % len(urls)], json=bodies[index]) as response:
                answer = await response.json()
            latencies.append(time.perf_counter() - started)
            if answer["response"]["allowed"]:
                allowed += 1
                fake.put(manifests[index])  # persisted, as the API server would after admission

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(pods)))
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "reviews_per_s": pods / elapsed,
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1000,
        "allowed": allowed,
    }


async def main(pods: int, concurrency: int, replicas: int) -> int:
    fit = pods * 9 // 10
    async with (
        FakeApiServer(namespaces=("default", "bench-free", "bench-quota")) as fake,
        AsyncExitStack() as stack,
    ):
        fake.put(gpu_quota("gpu", "bench-quota", gpu=f"{fit * CORE / 100:.2f}"))
        urls = await _replicas(stack, fake, replicas)
        session = await stack.enter_async_context(
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency))
        )
        await _burst(
            fake, session, urls, "default", pods=200, concurrency=concurrency
        )  # warm up connections
        free = await _burst(fake, session, urls, "bench-free", pods=pods, concurrency=concurrency)
        quota = await _burst(fake, session, urls, "bench-quota", pods=pods, concurrency=concurrency)
        status = (fake.get("gpuquotas", "gpu", "bench-quota") or {}).get("status") or {}
        reserved_core = int((status.get("reserved") or {}).get("core") or 0)
        reserved_core += int((status.get("used") or {}).get("core") or 0)
    over = quota["allowed"] - fit
    print(
        f"bench.quota: {pods} GPU pods per burst, {concurrency} in flight, {replicas} webhook "
        f"replicas, fake API server over HTTP"
    )
    for name, result in (("no quota", free), ("quota", quota)):
        print(
            f"  {name:9} {result['reviews_per_s']:8.0f} reviews/s   p50 {result['p50_ms']:6.1f} ms"
            f"   p99 {result['p99_ms']:6.1f} ms   allowed {result['allowed']}"
        )
    ratio = quota["reviews_per_s"] / free["reviews_per_s"]
    print(f"  ratio quota/no-quota: {ratio:.2f} (target >= 0.50)")
    print(
        f"  over-admission: {max(over, 0)} (admitted {quota['allowed']} of {pods}, "
        f"{fit} fit; charged {reserved_core / 100:.2f} cards of {fit * CORE / 100:.2f})"
    )
    return 0 if over == 0 and reserved_core <= fit * CORE else 1


def cli() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quota", description=__doc__)
    parser.add_argument("--pods", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=2)
    args = parser.parse_args()
    return asyncio.run(main(args.pods, args.concurrency, args.replicas))


if __name__ == "__main__":
    raise SystemExit(cli())
