"""Benchmark of ``/mutate`` over HTTPS: ``python -m bench.webhook``.

One server process (the real app, TLS, one core's worth) answers five kinds of review; one
load process drives it. The baseline is the same server answering a fixed allow for the same
GPU pod body, so the ratio isolates what admission itself costs on this (noisy, shared)
machine. Reported: closed-loop throughput with concurrent connections, and p50/p99 latency at
a fixed open-loop rate (500 requests/s by default).

``gpu-pod`` repeats one pod, as the replicas of a Job or Deployment do; the webhook remembers
normalised containers, so this is its common case. ``gpu-pod-new`` gives every request a
container name the webhook has not seen (more names than it remembers), so nothing is
answered from memory: the cost of a pod unlike any before it.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import json
import os
import ssl
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench._load import Result, closed_loop, open_loop, server_process

EXAMPLE = Path(__file__).parent.parent / "examples" / "admissionreview-pod.json"
MODELS = {"NVIDIA-H100-80GB-HBM3": 81559}
DISTINCT = 8192  # twice what the mutator remembers (webhook.normaliser.MEMO_SIZE)


def distinct_gpu_bodies(count: int = DISTINCT) -> list[bytes]:
    """The GPU pod with a different container name in each body."""
    review = json.loads(EXAMPLE.read_text())
    out = []
    for i in range(count):
        review["request"]["object"]["spec"]["containers"][0]["name"] = f"worker-{i}"
        out.append(json.dumps(review).encode())
    return out


def bodies() -> dict[str, bytes]:
    gpu = json.loads(EXAMPLE.read_text())
    nogpu = copy.deepcopy(gpu)
    del nogpu["request"]["object"]["spec"]["containers"][0]["resources"]
    deny = copy.deepcopy(gpu)
    limits = deny["request"]["object"]["spec"]["containers"][0]["resources"]
    limits["limits"] = limits["requests"] = {"fracgpu.io/gpu": "1500m"}
    return {
        name: json.dumps(b).encode() for name, b in (("gpu", gpu), ("nogpu", nogpu), ("deny", deny))
    }


async def _server(port: int, directory: Path) -> None:
    from certs.config import CertsConfig
    from certs.serving import open_serving
    from core.admission import AdmissionRequest, AdmissionResponse
    from webhook.config import AdmissionConfig
    from webhook.inventory import Inventory
    from webhook.mutation import Mutator
    from webhook.server import build_app
    from webhook.transport import listen

    async def fixed_allow(req: AdmissionRequest) -> AdmissionResponse:
        return AdmissionResponse.allow(req.uid)

    certs = await open_serving(CertsConfig(mode="directory", directory=directory), standalone=True)
    mutator = Mutator(AdmissionConfig(), Inventory(MODELS))
    app = build_app({"/mutate": mutator, "/baseline": fixed_allow})
    await listen(app, "127.0.0.1", port, certs.context)  # as fracgpu serve does, limits included
    print("ready", flush=True)
    await asyncio.Event().wait()


async def _drive(args: argparse.Namespace, port: int, ca: bytes) -> dict[str, dict[str, float]]:
    context = ssl.create_default_context(cadata=ca.decode())
    connector = aiohttp.TCPConnector(limit=args.connections, ssl=context)
    payload = bodies()
    cases: dict[str, tuple[str, list[bytes]]] = {
        "baseline": ("/baseline", [payload["gpu"]]),
        "gpu-pod": ("/mutate", [payload["gpu"]]),
        "gpu-pod-new": ("/mutate", distinct_gpu_bodies()),
        "no-gpu-pod": ("/mutate", [payload["nogpu"]]),
        "denial": ("/mutate", [payload["deny"]]),
    }
    results: dict[str, dict[str, float]] = {}
    async with aiohttp.ClientSession(connector=connector) as session:

        def sender(path: str, bodies: list[bytes]) -> Any:
            url = f"https://127.0.0.1:{port}{path}"
            headers = {"Content-Type": "application/json"}
            cycle = itertools.cycle(bodies)

            async def send() -> None:
                async with session.post(url, data=next(cycle), headers=headers) as resp:
                    reply = await resp.read()
                    if resp.status != 200 or b'"uid"' not in reply:
                        raise RuntimeError(resp.status)

            return send

        for send in [sender(*cases["baseline"])] * 2:  # warm up TLS sessions and code paths
            await closed_loop(send, args.connections, 0.5)
        # Interleave the cases in short rounds and keep medians: on a shared machine, load from
        # elsewhere then shifts every case alike instead of whichever ran at the wrong moment.
        rounds: dict[str, list[tuple[Result, Result]]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, (path, body) in cases.items():
                send = sender(path, body)
                throughput = await closed_loop(send, args.connections, args.seconds)
                latency = await open_loop(send, args.rate, args.seconds)
                rounds[name].append((throughput, latency))
        for name, measured in rounds.items():
            results[name] = {
                "rps": statistics.median(t.rate for t, _ in measured),
                "errors": sum(t.errors + lat.errors for t, lat in measured),
                "p50_ms": statistics.median(lat.p50_ms for _, lat in measured),
                "p99_ms": statistics.median(lat.p99_ms for _, lat in measured),
            }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.webhook", description=__doc__)
    parser.add_argument("--seconds", type=float, default=2.0, help="per measurement and round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians)")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--rate", type=float, default=500.0, help="open-loop requests/s")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_server(args.serve, args.dir))
        return 0

    with server_process("bench.webhook") as served:
        results = asyncio.run(_drive(args, served.port, served.ca_pem))
    base = results["baseline"]
    print(
        f"fracgpu webhook /mutate over HTTPS, {args.connections} connections, "
        f"median of {args.rounds} interleaved rounds of {args.seconds:g} s, open-loop latency "
        f"at {args.rate:.0f} req/s "
        f"({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs)"
    )
    print(f"{'case':12} {'req/s':>8} {'vs base':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7}")
    for name, r in results.items():
        print(
            f"{name:12} {r['rps']:8.0f} {r['rps'] / base['rps']:8.2f} "
            f"{r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {int(r['errors']):7d}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
