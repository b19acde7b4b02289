"""Benchmark: GPU pod admission with a GPUQuota against the same burst without one.

    python -m bench.quota [--pods 1000] [--rounds 3] [--concurrency 64] [--replicas 2]

One run, on this machine, measures both scenarios. The fake API server (tests/fakes, real
HTTP) runs in a process of its own, as kube-apiserver would; this process runs the webhook
replicas (the real admission server and quota service, each with its own kubernetes-asyncio
client; the elected one also runs the usage controller) and a client that sends the
AdmissionReviews of a same-namespace burst of GPU pods, creating each admitted pod in the
API server as kube-apiserver would after admission.

* "no quota": the namespace has no GPUQuota (the reviewer still has to find that out);
* "quota": one GPUQuota sized to admit 90 % of the burst, so every pod is checked and
  reserved with a status compare-and-swap, and the last tenth is denied.

The scenarios alternate for ``--rounds`` rounds (each round in fresh namespaces), so that
load from other processes on a shared machine hits both alike; each round's quota rate is
compared with the no-quota rate measured just before it.
Reported: reviews/s and p50/p99 latency per review (median round), the median of the paired
quota/no-quota ratios, and
the over-admission check of every quota round (pods admitted vs pods that fit; cards charged
vs the limit).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer
from kubernetes_asyncio.client import ApiClient, Configuration

from core.kube import GPUQUOTAS, PODS, call_json
from core.kube import NAMESPACES as NAMESPACES_API
from quota.config import QuotaConfig
from quota.service import open_quota
from tests.fakes.apiserver import FakeApiServer
from tests.quota_pods import gpu_pod, gpu_quota, review
from webhook.server import build_app

CORE, BLOCKS = 10, 4  # each pod: 0.10 card, 1024 MiB
NAMESPACES = ("default",)


async def serve_fake() -> None:
    """The API server process: print the URLs and token, serve until stdin closes.

    Besides the fake API server it serves ``POST /put``, which stores a pod as it is, UID
    included: kube-apiserver persists the UID that validating admission saw (design K4),
    while a client's create through the API would get a new one.
    """
    async with FakeApiServer(namespaces=NAMESPACES) as fake:

        async def put(request: web.Request) -> web.Response:
            fake.put(await request.json())
            return web.Response(status=201)

        app = web.Application()
        app.router.add_post("/put", put)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        print(fake.url, fake.token, f"http://127.0.0.1:{port}/put", flush=True)
        try:
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        finally:
            await runner.cleanup()


async def _replicas(stack: AsyncExitStack, url: str, token: str, count: int) -> list[str]:
    """Webhook replicas; each also runs the quota service (the elected one reconciles)."""
    urls = []
    for index in range(count):
        api = _client(url, token)
        stack.push_async_callback(api.close)
        config = QuotaConfig(
            timeout_s=30,
            request_timeout_s=10,
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


def _client(url: str, token: str) -> Any:
    config = Configuration(host=url)
    config.api_key = {"BearerToken": f"Bearer {token}"}
    return ApiClient(configuration=config)


async def _burst(
    persist: str,
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
            # Persisted, as the API server does after admission (outside the timed review).
            async with session.post(persist, json=manifests[index]) as response:
                assert response.status == 201

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(pods)))
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "reviews_per_s": pods / elapsed,
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[max(0, int(len(latencies) * 0.99) - 1)] * 1000,
        "allowed": allowed,
    }


async def main(pods: int, concurrency: int, replicas: int, rounds: int) -> int:
    fit = pods * 9 // 10
    limit_core = fit * CORE
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.quota",
        "--serve-fake",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None and process.stdin is not None
    free: list[dict[str, Any]] = []
    quota: list[dict[str, Any]] = []
    try:
        url, token, persist = (await process.stdout.readline()).decode().split()
        async with AsyncExitStack() as stack:
            api = _client(url, token)
            stack.push_async_callback(api.close)
            urls = await _replicas(stack, url, token, replicas)
            session = await stack.enter_async_context(
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency))
            )
            # Warm up connections and the leader election.
            await _burst(persist, session, urls, "default", pods=200, concurrency=concurrency)
            for index in range(rounds):
                free_ns, quota_ns = f"bench-free-{index}", f"bench-quota-{index}"
                for namespace in (free_ns, quota_ns):
                    body = {
                        "apiVersion": "v1",
                        "kind": "Namespace",
                        "metadata": {"name": namespace},
                    }
                    await call_json(api, "POST", NAMESPACES_API.path(), body=body)
                limit = gpu_quota("gpu", quota_ns, gpu=f"{limit_core / 100:.2f}")
                await call_json(api, "POST", GPUQUOTAS.path(quota_ns), body=limit)
                await asyncio.sleep(0.5)  # the replicas' GPUQuota caches see the new quota
                free.append(
                    await _burst(
                        persist, session, urls, free_ns, pods=pods, concurrency=concurrency
                    )
                )
                result = await _burst(
                    persist, session, urls, quota_ns, pods=pods, concurrency=concurrency
                )
                stored = await call_json(api, "GET", GPUQUOTAS.path(quota_ns, "gpu"))
                listed = await call_json(api, "GET", PODS.path(quota_ns))
                status = stored.get("status") or {}
                result["charged"] = int((status.get("reserved") or {}).get("core") or 0) + int(
                    (status.get("used") or {}).get("core") or 0
                )
                result["persisted"] = len(listed.get("items") or [])
                quota.append(result)
    finally:
        process.stdin.close()
        await process.wait()
    print(
        f"bench.quota: {pods} GPU pods per burst, {concurrency} in flight, {replicas} webhook "
        f"replicas, {rounds} rounds, fake API server over HTTP in its own process"
    )
    for index, (a, b) in enumerate(zip(free, quota, strict=True)):
        print(
            f"  round {index}: no quota {a['reviews_per_s']:5.0f}/s, quota "
            f"{b['reviews_per_s']:5.0f}/s (ratio {b['reviews_per_s'] / a['reviews_per_s']:.2f})"
        )
    ratios = sorted(
        b["reviews_per_s"] / a["reviews_per_s"] for a, b in zip(free, quota, strict=True)
    )
    for name, results in (("no quota", free), ("quota", quota)):
        result = sorted(results, key=lambda r: r["reviews_per_s"])[len(results) // 2]
        print(
            f"  {name:9} {result['reviews_per_s']:7.0f} reviews/s   p50 {result['p50_ms']:7.1f} ms"
            f"   p99 {result['p99_ms']:7.1f} ms   (median round)"
        )
    print(
        f"  ratio quota/no-quota, median of the paired rounds: {ratios[len(ratios) // 2]:.2f} "
        f"(target >= 0.50)"
    )
    over = max(max(r["allowed"] - fit, 0) for r in quota)
    worst = max(r["charged"] for r in quota)
    print(
        f"  over-admission: {over} in {rounds} quota rounds (admitted "
        f"{', '.join(str(r['allowed']) for r in quota)} of {pods}, {fit} fit; pods existing "
        f"{', '.join(str(r['persisted']) for r in quota)}; most charged {worst / 100:.2f} cards "
        f"of {limit_core / 100:.2f})"
    )
    return 0 if over == 0 and worst <= limit_core else 1


def cli() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quota", description=__doc__)
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--serve-fake", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fake:
        asyncio.run(serve_fake())
        return 0
    return asyncio.run(main(args.pods, args.concurrency, args.replicas, args.rounds))


if __name__ == "__main__":
    raise SystemExit(cli())
