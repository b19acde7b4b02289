"""Benchmark: creating GPU pods under a GPUQuota, against Kubernetes' own ResourceQuota.

    python -m bench.quota [--serial 100] [--pods 1000] [--concurrency 16] [--rounds 3]
                          [--replicas 2] [--write-ms 5] [--no-forward]
    python -m bench.quota --burst 10000 [--replicas 2] [--concurrency 64]
    python -m bench.quota --release [--rounds 3]
    python -m bench.quota --kubeconfig FILE [--serial 100] [--pods 300] [--concurrency 16]

Without ``--kubeconfig`` everything runs on this machine. The fake API server (testkit/, real
HTTP) runs in a process of its own, as kube-apiserver would, and charges every write
``--write-ms`` as an etcd commit would. Each webhook replica (the real quota service with its
own kubernetes-asyncio client) runs in a process of its own too, as webhook pods do; they elect
the usage controller's leader over a Lease and send it their decisions, as in a cluster
(``--no-forward``: each replica decides its own pods). This process runs the clients, which
send the pods to the replicas in turn. Two cases, alternated round by round so that load from
other processes on a shared machine hits both alike, each in fresh namespaces:

* "resourcequota": the pod create that Kubernetes' built-in ResourceQuota costs, modelled in
  the API server process as kube-apiserver does it: the quota is checked in process, one
  quota status write per batch of waiting pods of a namespace (an UpdateStatus request that
  kube-apiserver sends itself through its loopback client), then the pod is written;
* "fracgpu": the validating webhook decides the pod against a GPUQuota (its status write goes
  through the API server, as it does in a cluster), then the API server writes the pod.

Each case is measured one pod at a time (``--serial`` pods: p50 latency) and with
``--concurrency`` in flight (``--pods`` pods: pods/s and p99), and fracgpu is reported as a
ratio to the ResourceQuota baseline of the same round. Both quotas admit 90 % of the
concurrent burst; the over-admission check compares what was admitted with what fits.

``--burst N`` sends N pods in one namespace through ``--replicas`` replicas with the
controller running, and reports admitted vs fit, the largest GPUQuota status write and the
final status size. ``--release`` times how long a pod that was admitted but never created,
and one deleted 10 ms after it was created, stay charged (default configuration).

With ``--kubeconfig`` the same two cases run against a real cluster where fracgpu is installed
(both webhooks registered and the GPUQuota CRD applied): "resourcequota" creates pods asking
an extended resource no webhook looks at (``example.com/bench``) in a namespace with a
ResourceQuota on it; "fracgpu" creates pods asking ``fracgpu.io/gpu: --gpu`` in a namespace
with a GPUQuota. Pods are created (they stay Pending) and the namespaces deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from kubernetes_asyncio.client import Configuration

from core.kube import (
    GPUQUOTAS,
    NAMESPACES,
    PODS,
    KubeError,
    Resource,
    api_client,
    call_json,
    kube_client,
)
from quota.config import QuotaConfig
from quota.forward import DECIDE_PATH
from quota.service import open_quota
from testkit.apiserver import FakeApiServer
from testkit.kinds import Kind
from testkit.quota_pods import gpu_pod, gpu_quota, review
from webhook.server import build_app

CORE, BLOCKS = 10, 4  # each pod: 0.10 card, 1024 MiB
RESOURCEQUOTAS = Resource("", "v1", "resourcequotas", namespaced=True)
# Kubernetes' own quota object, which the fake API server serves only when asked (no quota logic:
# the benchmark decides and writes it as kube-apiserver would).
RESOURCEQUOTA = Kind("", "v1", "ResourceQuota", "resourcequotas", True, status_subresource=True)
BENCH_RESOURCE = "example.com/bench"
BENCH_QUOTA = f"requests.{BENCH_RESOURCE}"

Create = Callable[[int], Awaitable[bool]]  # create pod number i; whether it was admitted


# --- the API server process ------------------------------------------------------------------


class BuiltinQuota:
    """Kubernetes' ResourceQuota admission as kube-apiserver runs it: waiters of a namespace are
    decided in batches against a running copy in process, and each batch costs one status
    write, which kube-apiserver makes through its own loopback client (the admission plugin's
    ``UpdateStatus``: a full API request to itself, then the etcd commit)."""

    def __init__(self, write: Callable[[str, int], Awaitable[None]]) -> None:
        self.write = write
        self.limits: dict[str, int] = {}
        self.used: dict[str, int] = {}
        self._queues: dict[str, list[tuple[int, asyncio.Future[bool]]]] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}

    async def admit(self, namespace: str, amount: int) -> bool:
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(namespace, []).append((amount, future))
        if namespace not in self._workers:
            self._workers[namespace] = asyncio.create_task(self._drain(namespace))
        return await future

    async def _drain(self, namespace: str) -> None:
        try:
            while self._queues.get(namespace):
                batch = self._queues.pop(namespace)
                used, decided = self.used.get(namespace, 0), []
                for amount, future in batch:
                    fits = used + amount <= self.limits.get(namespace, 0)
                    used += amount if fits else 0
                    decided.append((future, fits))
                await self.write(namespace, used)  # the quota's status write
                self.used[namespace] = used
                for future, fits in decided:
                    future.set_result(fits)
        finally:
            self._workers.pop(namespace, None)


async def serve_fake(write_s: float) -> None:
    """The API server process: print the URLs and token, serve until stdin closes.

    Beside the fake API server it serves ``POST /put`` (a pod admitted by the webhooks, written
    with the UID that admission saw, as kube-apiserver does), ``POST /rq-create`` (a pod create
    under the built-in ResourceQuota), ``POST /rq-limit`` and ``GET /stats``.
    """
    async with (
        FakeApiServer(namespaces=("default",)) as fake,
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {fake.token}"}) as loopback,
    ):
        fake.write_latency = write_s
        fake.register(RESOURCEQUOTA)

        async def write_status(namespace: str, used: int) -> None:
            """kube-apiserver's quota write: an UpdateStatus request to itself."""
            path = RESOURCEQUOTAS.path(namespace, "bench") + "/status"
            quota = fake.get("resourcequotas", "bench", namespace)
            assert quota is not None
            quota["status"] = {"hard": quota["spec"]["hard"], "used": {BENCH_QUOTA: str(used)}}
            async with loopback.put(fake.url + path, json=quota) as reply:
                assert reply.status == 200, await reply.text()

        builtin = BuiltinQuota(write_status)

        async def put(request: web.Request) -> web.Response:
            pod = await request.json()
            await asyncio.sleep(write_s)  # the pod's own write
            fake.put(pod)
            return web.Response(status=201)

        async def rq_create(request: web.Request) -> web.Response:
            pod = await request.json()
            if not await builtin.admit(pod["metadata"]["namespace"], CORE):
                return web.Response(status=403)
            await asyncio.sleep(write_s)
            fake.put(pod)
            return web.Response(status=201)

        async def rq_limit(request: web.Request) -> web.Response:
            body = await request.json()
            namespace = body["namespace"]
            builtin.limits[namespace] = body["limit"]
            hard = {BENCH_QUOTA: str(body["limit"])}
            fake.put(
                {
                    "apiVersion": "v1",
                    "kind": "ResourceQuota",
                    "metadata": {"name": "bench", "namespace": namespace},
                    "spec": {"hard": hard},
                    "status": {"hard": hard, "used": {BENCH_QUOTA: "0"}},
                }
            )
            return web.Response(status=204)

        async def stats(_: web.Request) -> web.Response:
            writes = [
                r.body_bytes
                for r in fake.requests
                if r.method == "PUT" and r.path.startswith("/apis/fracgpu.io/")
            ]
            fake.requests.clear()
            return web.json_response({"status_writes": len(writes), "largest": max(writes or [0])})

        app = web.Application(client_max_size=4 * 1024 * 1024)
        app.router.add_post("/put", put)
        app.router.add_post("/rq-create", rq_create)
        app.router.add_post("/rq-limit", rq_limit)
        app.router.add_get("/stats", stats)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        print(fake.url, fake.token, f"http://127.0.0.1:{port}", flush=True)
        try:
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        finally:
            await runner.cleanup()


# --- measuring ------------------------------------------------------------------------------


@dataclass
class Result:
    latencies: list[float] = field(default_factory=list)
    elapsed: float = 0.0
    admitted: int = 0

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.elapsed

    def quantile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[max(0, int(len(ordered) * q + 0.5) - 1)] * 1000

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies) * 1000


async def measure(create: Create, count: int, concurrency: int) -> Result:
    result = Result()
    gate = asyncio.Semaphore(concurrency)

    async def one(index: int) -> None:
        async with gate:
            started = time.perf_counter()
            admitted = await create(index)
            result.latencies.append(time.perf_counter() - started)
        result.admitted += admitted

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(count)))
    result.elapsed = time.perf_counter() - started
    return result


@dataclass
class Round:
    serial: dict[str, Result]
    burst: dict[str, Result]


def report(rounds: list[Round], fit: int, pods: int, over: int) -> int:
    for index, r in enumerate(rounds):
        print(
            f"  round {index}: one at a time p50 resourcequota {r.serial['rq'].p50:6.1f} ms, "
            f"fracgpu {r.serial['gq'].p50:6.1f} ms; in flight resourcequota "
            f"{r.burst['rq'].rate:5.0f} pods/s (p99 {r.burst['rq'].quantile(0.99):6.1f} ms), "
            f"fracgpu {r.burst['gq'].rate:5.0f} pods/s (p99 {r.burst['gq'].quantile(0.99):6.1f} ms)"
        )
    latency = statistics.median(r.serial["gq"].p50 / r.serial["rq"].p50 for r in rounds)
    rate = statistics.median(r.burst["gq"].rate / r.burst["rq"].rate for r in rounds)
    tail = statistics.median(
        r.burst["gq"].quantile(0.99) / r.burst["rq"].quantile(0.99) for r in rounds
    )
    print(
        f"  fracgpu / resourcequota, median of the rounds: latency one at a time {latency:.2f}x "
        f"(target <= 1.3), throughput in flight {rate:.2f}x (target >= 0.8), "
        f"p99 in flight {tail:.2f}x (target <= 1.5)"
    )
    admitted = [r.burst["gq"].admitted for r in rounds]
    print(
        f"  over-admission: {over} (fracgpu admitted {', '.join(map(str, admitted))} of {pods}, "
        f"{fit} fit; resourcequota admitted "
        f"{', '.join(str(r.burst['rq'].admitted) for r in rounds)})"
    )
    return 0 if over == 0 else 1


# --- on this machine ------------------------------------------------------------------------


def _client(url: str, token: str) -> Any:
    config = Configuration(host=url)
    config.api_key = {"BearerToken": f"Bearer {token}"}
    return api_client(config)


async def serve_replica(url: str, token: str, *, forward: bool) -> None:
    """One webhook replica in a process of its own, as a webhook pod is: print its URL, serve
    until stdin closes. Replicas elect the controller's leader over a Lease, as in a cluster,
    and (unless ``forward`` is off) send their quota decisions to it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    address = f"http://127.0.0.1:{sock.getsockname()[1]}"
    api = _client(url, token)
    config = QuotaConfig(
        timeout_s=30,
        request_timeout_s=10,
        # Short periods: a replica learns where the leader is at its next try.
        leader_election={
            "lease_namespace": "default",
            "identity": address,
            "renew_interval_s": 0.5,
            "lease_duration_s": 5,
        },
        forward_to_leader=forward,
        advertise_url=address,
    )
    service = await open_quota(config, api)
    task = asyncio.create_task(service.run())
    app = build_app(
        {"/validate": service.reviewer}, handlers={DECIDE_PATH: service.decide_endpoint}
    )
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    print(f"{address}/validate", flush=True)
    try:
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    finally:
        task.cancel()
        await runner.cleanup()
        await service.close()
        await api.close()


async def _spawn(stack: AsyncExitStack, *args: str) -> str:
    """Start ``python -m bench.quota ARGS`` and return the first line it prints; it stops when
    the stack closes its stdin."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.quota",
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None and process.stdin is not None
    stdin = process.stdin

    async def stop() -> None:
        stdin.close()
        await process.wait()

    stack.push_async_callback(stop)
    return (await process.stdout.readline()).decode().strip()


async def _replicas(
    stack: AsyncExitStack, url: str, token: str, count: int, *, forward: bool
) -> list[str]:
    """Webhook replicas, each in its own process over HTTP; once one leads the controller (and
    the others know where it is), their URLs."""
    extra = [] if forward else ["--no-forward"]
    urls = [await _spawn(stack, "--serve-replica", url, token, *extra) for _ in range(count)]
    await asyncio.sleep(1.5)  # the others learn the leader's address at their next try
    return urls


class Local:
    """The two cases on this machine; see the module docstring."""

    def __init__(
        self, api: Any, extra: str, session: aiohttp.ClientSession, urls: list[str]
    ) -> None:
        self.api, self.extra, self.session, self.urls = api, extra, session, urls

    async def namespace(self, name: str) -> None:
        body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
        await call_json(self.api, "POST", NAMESPACES.path(), body=body)

    async def resourcequota(self, namespace: str, limit: int) -> Create:
        await self.namespace(namespace)
        await self._post("/rq-limit", {"namespace": namespace, "limit": limit})
        pods = [gpu_pod(f"p{i}", CORE, BLOCKS, namespace=namespace) for i in range(limit * 2)]

        async def create(index: int) -> bool:
            async with self.session.post(self.extra + "/rq-create", json=pods[index]) as reply:
                return reply.status == 201

        return create

    async def fracgpu(self, namespace: str, limit: int) -> Create:
        await self.namespace(namespace)
        quota = gpu_quota("gpu", namespace, gpu=f"{limit / 100:.2f}")
        await call_json(self.api, "POST", GPUQUOTAS.path(namespace), body=quota)
        await self.counted(namespace)
        pods = [gpu_pod(f"p{i}", CORE, BLOCKS, namespace=namespace) for i in range(limit * 2)]
        bodies = [
            {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": review(p)}
            for p in pods
        ]

        async def create(index: int) -> bool:
            url = self.urls[index % len(self.urls)]
            async with self.session.post(url, json=bodies[index]) as reply:
                answer = await reply.json()
            if not answer["response"]["allowed"]:
                return False
            async with self.session.post(self.extra + "/put", json=pods[index]) as reply:
                return reply.status == 201

        return create

    async def counted(self, namespace: str) -> None:
        """Wait until the controller has counted the new quota (admission waits for it too)."""
        for _ in range(500):
            obj = await call_json(self.api, "GET", GPUQUOTAS.path(namespace, "gpu"))
            conditions = (obj.get("status") or {}).get("conditions") or []
            if any(c["type"] == "Counted" and c["status"] == "True" for c in conditions):
                return
            await asyncio.sleep(0.01)
        raise RuntimeError(f"GPUQuota {namespace}/gpu was not counted within 5 s")

    async def _post(self, path: str, body: Any) -> None:
        async with self.session.post(self.extra + path, json=body) as reply:
            assert reply.status < 300, reply.status

    async def stats(self) -> dict[str, int]:
        async with self.session.get(self.extra + "/stats") as reply:
            result: dict[str, int] = await reply.json()
            return result


async def _local(args: argparse.Namespace, run: Callable[[Local], Awaitable[int]]) -> int:
    async with AsyncExitStack() as stack:
        line = await _spawn(stack, "--serve-fake", "--write-ms", str(args.write_ms))
        url, token, extra = line.split()
        api = _client(url, token)
        stack.push_async_callback(api.close)
        urls = await _replicas(stack, url, token, args.replicas, forward=args.forward)
        connector = aiohttp.TCPConnector(limit=max(args.concurrency, 1) * 2)
        session = await stack.enter_async_context(aiohttp.ClientSession(connector=connector))
        return await run(Local(api, extra, session, urls))


async def compare(args: argparse.Namespace, cases: Any) -> int:
    """The alternating rounds, with ``cases`` providing ``resourcequota`` and ``fracgpu``."""
    fit = args.pods * 9 // 10
    rounds, over = [], 0
    # Warm-up: connections, caches, the controller's first pass.
    for name, make in (("rq", cases.resourcequota), ("gq", cases.fracgpu)):
        await measure(await make(f"bench-warm-{name}", 10_000), 50, args.concurrency)
    for index in range(args.rounds):
        serial, burst = {}, {}
        for name, make in (("rq", cases.resourcequota), ("gq", cases.fracgpu)):
            create = await make(f"bench-{name}-serial-{index}", 10_000)
            serial[name] = await measure(create, args.serial, 1)
        for name, make in (("rq", cases.resourcequota), ("gq", cases.fracgpu)):
            create = await make(f"bench-{name}-burst-{index}", fit * CORE)
            before = cpu_seconds(args.cpu_of)
            burst[name] = await measure(create, args.pods, args.concurrency)
            spent = cpu_seconds(args.cpu_of)
            if args.cpu_of:
                cost = {k: (spent[k] - before.get(k, 0.0)) * 1000 / args.pods for k in spent}
                print(
                    f"  round {index} {name} burst: CPU ms per pod "
                    + ", ".join(f"{k} {v:.2f}" for k, v in sorted(cost.items()))
                )
        over = max(over, burst["gq"].admitted - fit)
        rounds.append(Round(serial, burst))
    status_bytes = getattr(cases, "status_bytes", None)
    if status_bytes is not None:  # against a cluster: what the bursts left, and the trend
        for index, done in enumerate(rounds):
            size = await status_bytes(f"bench-gq-burst-{index}")
            first, last = flat(done.burst["gq"], fit)
            print(
                f"  round {index}: GPUQuota status after {fit} admissions {size} bytes; p50 of "
                f"the first tenth of the burst {first:.1f} ms, of the tenth that filled it "
                f"{last:.1f} ms"
            )
    return report(rounds, fit, args.pods, over)


def cpu_seconds(names: list[str]) -> dict[str, float]:
    """User and system CPU seconds of this machine's processes whose command line contains
    each of ``names`` (a cluster on this machine: kube-apiserver, etcd, fracgpu serve)."""
    tick = os.sysconf("SC_CLK_TCK")
    found = dict.fromkeys(names, 0.0)
    for entry in os.listdir("/proc") if names else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                command = fh.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rpartition(")")[2].split()
        except OSError:
            continue
        for name in names:
            if name in command:
                found[name] += (int(fields[11]) + int(fields[12])) / tick
    return found


def flat(result: Any, fit: int) -> tuple[float, float]:
    """p50 (ms) of the first tenth of a burst's creates, in order of completion, and of the
    tenth that filled the quota (the denials after it write nothing and would flatter it)."""
    tenth = max(1, len(result.latencies) // 10)
    first = statistics.median(result.latencies[:tenth]) * 1000
    last = statistics.median(result.latencies[max(0, fit - tenth) : fit]) * 1000
    return first, last


async def burst(args: argparse.Namespace, local: Local) -> int:
    fit = args.burst * 9 // 10
    create = await local.fracgpu("bench-burst", fit * CORE)
    await local.stats()  # only the burst's writes from here on
    result = await measure(create, args.burst, args.concurrency)
    stats = await local.stats()
    await asyncio.sleep(1.0)  # the controller matches the last admissions to their pods
    obj = await call_json(local.api, "GET", GPUQUOTAS.path("bench-burst", "gpu"))
    status = obj.get("status") or {}
    pods = await call_json(local.api, "GET", PODS.path("bench-burst"))
    print(
        f"bench.quota --burst: {args.burst} GPU pods in one namespace, {args.replicas} webhook "
        f"replicas, {args.concurrency} in flight, controller running"
    )
    print(
        f"  admitted {result.admitted} ({fit} fit), pods existing {len(pods.get('items') or [])},"
        f" over-admission {max(0, result.admitted - fit)}, {result.rate:.0f} pods/s, p50 "
        f"{result.p50:.1f} ms, p99 {result.quantile(0.99):.1f} ms"
    )
    tenth = max(1, len(result.latencies) // 10)
    first, last = flat(result, fit)
    print(
        f"  flat: p50 of creates 1-{tenth} {first:.1f} ms, "
        f"of creates {fit - tenth + 1}-{fit} {last:.1f} ms"
    )
    print(
        f"  GPUQuota status writes {stats['status_writes']}, largest {stats['largest']} bytes; "
        f"final status {len(json.dumps(status))} bytes, used "
        f"{(status.get('used') or {}).get('cards')} cards of {fit * CORE / 100:.2f}"
    )
    return 0 if result.admitted <= fit and stats["largest"] <= 8 * 1024 else 1


async def release(args: argparse.Namespace, local: Local) -> int:
    """How long what a pod held stays charged when the pod never exists or goes at once."""
    print(
        "bench.quota --release: default quota configuration, controller running; time from the "
        "admission until the GPUQuota no longer charges the pod"
    )
    worst = 0.0
    for case in ("never created", "deleted after 10 ms"):
        namespace = f"bench-release-{case.split()[0]}"
        create = await local.fracgpu(namespace, 100)  # one pod of 0.10 card fits, not two
        for attempt in range(args.rounds):
            started = time.perf_counter()
            if case == "never created":  # admitted, then the create fails after admission
                pod = gpu_pod(f"ghost{attempt}", CORE, BLOCKS, namespace=namespace)
                body: dict[str, Any] = {
                    "apiVersion": "admission.k8s.io/v1",
                    "kind": "AdmissionReview",
                    "request": review(pod),
                }
                async with local.session.post(local.urls[0], json=body) as reply:
                    assert (await reply.json())["response"]["allowed"]
            else:
                assert await create(attempt * 2 + 1)
                await asyncio.sleep(0.01)
                await call_json(local.api, "DELETE", PODS.path(namespace, f"p{attempt * 2 + 1}"))
            while True:
                obj = await call_json(local.api, "GET", GPUQUOTAS.path(namespace, "gpu"))
                if not ((obj.get("status") or {}).get("used") or {}).get("core"):
                    break
                await asyncio.sleep(0.05)
            elapsed = time.perf_counter() - started
            worst = max(worst, elapsed)
            print(f"  {case}: released after {elapsed:.2f} s")
    print(f"  slowest: {worst:.2f} s (target <= 15 s)")
    return 0 if worst <= 15 else 1


# --- against a cluster ----------------------------------------------------------------------


class Cluster:
    """The two cases against a real API server (see the module docstring)."""

    def __init__(
        self,
        api: Any,
        gpu: str,
        run: str,
        settle_s: float = 10.0,
        labels: dict[str, str] | None = None,
    ) -> None:
        self.api, self.gpu, self.run = api, gpu, run
        self.settle_s = settle_s  # how long a new quota may take to get its first status
        self.labels = labels or {}  # on fracgpu's namespaces (a webhook's namespaceSelector)
        self.namespaces: list[str] = []

    async def namespace(self, name: str, labels: dict[str, str] | None = None) -> str:
        name = f"{name}-{self.run}"
        metadata: dict[str, Any] = {"name": name, "labels": labels or {}}
        body = {"apiVersion": "v1", "kind": "Namespace", "metadata": metadata}
        await call_json(self.api, "POST", NAMESPACES.path(), body=body)
        self.namespaces.append(name)
        return name

    def _creator(self, namespace: str, resources: dict[str, str]) -> Create:
        async def create(index: int) -> bool:
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"p{index}", "namespace": namespace},
                "spec": {
                    "containers": [
                        {"name": "main", "image": "pause", "resources": {"limits": resources}}
                    ]
                },
            }
            try:
                await call_json(self.api, "POST", PODS.path(namespace), body=pod)
            except KubeError as err:
                if err.status == 403:  # denied by the quota
                    return False
                raise
            return True

        return create

    async def resourcequota(self, name: str, limit: int) -> Create:
        namespace = await self.namespace(name)
        quota = {
            "apiVersion": "v1",
            "kind": "ResourceQuota",
            "metadata": {"name": "bench", "namespace": namespace},
            "spec": {"hard": {BENCH_QUOTA: str(limit // CORE)}},
        }
        await call_json(self.api, "POST", RESOURCEQUOTAS.path(namespace), body=quota)
        # kube-controller-manager fills status.hard; until then the built-in quota denies.
        for _ in range(int(self.settle_s * 10)):
            obj = await call_json(self.api, "GET", RESOURCEQUOTAS.path(namespace, "bench"))
            if (obj.get("status") or {}).get("hard"):
                break
            await asyncio.sleep(0.1)
        return self._creator(namespace, {BENCH_RESOURCE: "1"})

    async def fracgpu(self, name: str, limit: int) -> Create:
        namespace = await self.namespace(name, self.labels)
        cards = limit // CORE * float(self.gpu)
        quota = gpu_quota("gpu", namespace, gpu=f"{cards:.2f}")
        await call_json(self.api, "POST", GPUQUOTAS.path(namespace), body=quota)
        for _ in range(int(self.settle_s * 10)):
            obj = await call_json(self.api, "GET", GPUQUOTAS.path(namespace, "gpu"))
            conditions = (obj.get("status") or {}).get("conditions") or []
            if any(c["type"] == "Counted" and c["status"] == "True" for c in conditions):
                break
            await asyncio.sleep(0.1)
        return self._creator(namespace, {"fracgpu.io/gpu": self.gpu})

    async def status_bytes(self, name: str) -> int:
        obj = await call_json(self.api, "GET", GPUQUOTAS.path(f"{name}-{self.run}", "gpu"))
        return len(json.dumps(obj.get("status") or {}))

    async def cleanup(self) -> None:
        for name in self.namespaces:
            await call_json(self.api, "DELETE", NAMESPACES.path(None, name))


async def cluster(args: argparse.Namespace) -> int:
    async with kube_client(args.kubeconfig, args.context) as api:
        labels = dict(pair.split("=", 1) for pair in args.namespace_label)
        cases = Cluster(api, args.gpu, uuid.uuid4().hex[:6], args.settle_s, labels)
        print(
            f"bench.quota against {args.kubeconfig}: {args.serial} pods one at a time, "
            f"{args.pods} with {args.concurrency} in flight, {args.rounds} rounds"
        )
        try:
            return await compare(args, cases)
        finally:
            await cases.cleanup()


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.quota",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--serial", type=int, default=100, help="pods one at a time per case")
    parser.add_argument("--pods", type=int, default=1000, help="pods with --concurrency")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--write-ms", type=float, default=5.0, help="cost of one write (etcd)")
    parser.add_argument("--burst", type=int, default=0, help="one namespace, this many pods")
    parser.add_argument(
        "--release", action="store_true", help="time the release of pods never created or deleted"
    )
    parser.add_argument("--kubeconfig", help="run against this cluster (fracgpu installed)")
    parser.add_argument("--context", help="kubeconfig context")
    parser.add_argument(
        "--cpu-of",
        action="append",
        default=[],
        metavar="TEXT",
        help="with a cluster on this machine: report the CPU per pod of each burst spent by the "
        "processes whose command line contains TEXT (repeatable: kube-apiserver, etcd, ...)",
    )
    parser.add_argument(
        "--namespace-label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="label fracgpu's bench namespaces (where the webhooks select namespaces by label)",
    )
    parser.add_argument("--gpu", default="0.1", help="cards per pod against a cluster")
    parser.add_argument("--settle-s", type=float, default=10.0, help=argparse.SUPPRESS)
    parser.add_argument("--serve-fake", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--serve-replica", nargs=2, metavar=("URL", "TOKEN"), help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--no-forward",
        dest="forward",
        action="store_false",
        help="every replica decides its own pods (quota.forward_to_leader: false)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command; ``python -m bench`` (``make bench``) calls it with no arguments."""
    args = parser().parse_args(argv)
    if args.serve_fake:
        asyncio.run(serve_fake(args.write_ms / 1000))
        return 0
    if args.serve_replica:
        url, token = args.serve_replica
        asyncio.run(serve_replica(url, token, forward=args.forward))
        return 0
    if args.kubeconfig:
        return asyncio.run(cluster(args))
    if args.burst:
        return asyncio.run(_local(args, lambda local: burst(args, local)))
    if args.release:
        return asyncio.run(_local(args, lambda local: release(args, local)))
    print(
        f"bench.quota: {args.serial} pods one at a time, {args.pods} with {args.concurrency} in "
        f"flight, {args.replicas} webhook replicas, {args.rounds} rounds, fake API server over "
        f"HTTP in its own process, {args.write_ms:g} ms per write"
    )
    return asyncio.run(_local(args, lambda local: compare(args, local)))


if __name__ == "__main__":
    raise SystemExit(main())
