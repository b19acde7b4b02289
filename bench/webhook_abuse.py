"""The webhook under abuse: ``python -m bench.webhook_abuse``.

Three processes on loopback: the real admission server (``listen`` with the default
``server.limits``, the real mutator, TLS), an abuser, and a prober that sends ordinary GPU-pod
reviews at a fixed open-loop rate and measures their latency from the scheduled send time.

Phases, each bounded in time:

``baseline``  the prober alone (no abuse): the same-run reference.
``ramp``      the abuser opens ``--idle`` TLS connections (at most ``--ramp-rate`` a second)
              and leaves them idle, and starts ``--bodies`` senders that each post an
              ``--body-mib`` body again and again: half complete AdmissionReviews padded
              with environment variables, half sent slowly and abandoned halfway.
``abuse``     the same abuse, held for ``--seconds``, once every idle connection is open.
``after``     the abuser closed everything; ``--settle`` seconds later, the prober again.

Reported per phase: the prober's p50/p99/max and errors, the server's peak RSS
(``/proc/<pid>/status``), and what the server did to the abuse (its own metrics).
The server inherits this process's environment, so malloc settings can be compared:
``MALLOC_ARENA_MAX=2 python -m bench.webhook_abuse``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import multiprocessing
import os
import ssl
import sys
import threading
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from bench._load import Result, open_loop, server_process

EXAMPLE = Path(__file__).parent.parent / "examples" / "admissionreview-pod.json"
MODELS = {"NVIDIA-H100-80GB-HBM3": 81559}
MIB = 2**20


def large_review(size: int, *, dense: bool = False) -> bytes:
    """The example GPU pod, padded with environment variables to exactly ``size`` bytes; or,
    ``dense``, with a field of one-digit numbers, the costliest JSON to parse per byte."""
    review = json.loads(EXAMPLE.read_text())
    if dense:
        base = len(json.dumps(review).encode())
        review["request"]["object"]["padding"] = [0] * ((size - base - 20) // 2)
        return json.dumps(review, separators=(",", ":")).encode().ljust(size)
    container = review["request"]["object"]["spec"]["containers"][0]
    base = len(json.dumps(review).encode())
    entry = len(json.dumps({"name": "VAR_00000", "value": "x" * 1000})) + 2
    container["env"] = [{"name": f"VAR_{i:05d}", "value": "x" * 1000} for i in range(0, 8192)][
        : (size - base) // entry
    ]
    body = json.dumps(review).encode()
    return body.ljust(size)  # JSON allows trailing whitespace


# --- server ----------------------------------------------------------------------------------


async def _serve(port: int, directory: Path) -> None:
    from aiohttp import web

    from certs.config import CertsConfig
    from certs.serving import open_serving
    from webhook.config import AdmissionConfig, ServerLimits
    from webhook.inventory import Inventory
    from webhook.metrics import AdmissionMetrics
    from webhook.mutation import Mutator
    from webhook.server import build_app
    from webhook.transport import listen

    certs = await open_serving(CertsConfig(mode="directory", directory=directory), standalone=True)
    metrics = AdmissionMetrics(CollectorRegistry())
    app = build_app(
        {"/mutate": Mutator(AdmissionConfig(), Inventory(MODELS))},
        metrics=metrics,
        limits=ServerLimits(),
    )
    stalls: list[float] = []

    async def watch_loop() -> None:
        """Records how late a 5 ms timer fires: the event loop's stalls, which every
        request waiting at that moment shares."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + 0.005
            await asyncio.sleep(0.005)
            stalls.append(loop.time() - due)

    collections: list[tuple[int, float]] = []  # (generation, seconds) of each GC pass
    started: list[float] = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            collections.append((info["generation"], time.perf_counter() - started[0]))

    gc.callbacks.append(on_gc)

    async def report_stalls(_: web.Request) -> web.Response:
        ms = sorted(x * 1000 for x in stalls)
        full = [t * 1000 for gen, t in collections if gen == 2]
        stalls.clear()
        collections.clear()
        summary = {
            "samples": len(ms),
            "over_5ms": sum(1 for x in ms if x > 5),
            "over_10ms": sum(1 for x in ms if x > 10),
            "p99_ms": round(ms[int(0.99 * (len(ms) - 1))], 2) if ms else 0.0,
            "max_ms": round(ms[-1], 2) if ms else 0.0,
            "full_gcs": len(full),
            "full_gc_max_ms": round(max(full), 1) if full else 0.0,
        }
        return web.json_response(summary)

    app.router.add_get("/bench/stalls", report_stalls)
    await listen(app, "127.0.0.1", port, certs.context)
    watcher = asyncio.ensure_future(watch_loop())
    print("ready", flush=True)
    await asyncio.Event().wait()
    watcher.cancel()


# --- abuser (own process) --------------------------------------------------------------------


async def _abuse(port: int, ca: str, args: argparse.Namespace, stop: Any, report: Any) -> None:
    context = ssl.create_default_context(cadata=ca)
    held: list[asyncio.StreamWriter] = []
    failed = 0
    statuses: dict[str, int] = {}
    body = large_review(args.body_mib * MIB, dense=args.dense)
    head = (
        f"POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()

    async def open_idle() -> None:
        nonlocal failed
        try:
            _, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=context, server_hostname="localhost"
            )
            held.append(writer)
        except (OSError, ssl.SSLError, TimeoutError):
            failed += 1

    async def sender(slow: bool) -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", port, ssl=context, server_hostname="localhost"
                )
            except (OSError, ssl.SSLError):
                statuses["connect-failed"] = statuses.get("connect-failed", 0) + 1
                await asyncio.sleep(0.1)
                continue
            try:
                if slow:  # half the body, slowly, then gone
                    writer.write(head)
                    for i in range(0, len(body) // 2, 256 * 1024):
                        writer.write(body[i : i + 256 * 1024])
                        await writer.drain()
                        await asyncio.sleep(0.2)
                    writer.transport.abort()
                    statuses["abandoned"] = statuses.get("abandoned", 0) + 1
                    continue
                writer.write(head + body)
                await writer.drain()
                line = await asyncio.wait_for(reader.readline(), 30)
                status = line.split()[1].decode() if line else "closed"
                statuses[status] = statuses.get(status, 0) + 1
            except (OSError, ssl.SSLError, TimeoutError, IndexError):
                statuses["error"] = statuses.get("error", 0) + 1
            finally:
                writer.transport.abort()

    senders = [asyncio.ensure_future(sender(i % 2 == 1)) for i in range(args.bodies)]
    opening = []
    for _ in range(args.idle):
        opening.append(asyncio.ensure_future(open_idle()))
        await asyncio.sleep(1 / args.ramp_rate)
    await asyncio.gather(*opening)
    still_open = sum(1 for w in held if not w.transport.is_closing())
    report.put({"ramped": True, "opened": len(held), "failed": failed, "open": still_open})
    await asyncio.to_thread(stop.wait)
    still_open = sum(1 for w in held if not w.transport.is_closing())
    for s in senders:
        s.cancel()
    await asyncio.gather(*senders, return_exceptions=True)
    for w in held:
        w.transport.abort()
    report.put({"done": True, "open_at_end": still_open, "bodies": statuses})


def _abuser_main(port: int, ca: str, args: argparse.Namespace, stop: Any, report: Any) -> None:
    # In a cluster the abuser runs on another node; here it shares two cores with the server,
    # and at equal priority its own TLS work would starve the server it is measuring.
    os.nice(19)
    asyncio.run(_abuse(port, ca, args, stop, report))


# --- prober and conductor --------------------------------------------------------------------


class Rss:
    """Samples a process's resident memory every 50 ms; its peak and CPU share since the last
    ``reset()``."""

    def __init__(self, pid: int) -> None:
        self.path = Path(f"/proc/{pid}/status")
        self.now_kib = 0
        self._peak = 0
        self._cpu_at, self._wall_at = self._cpu_s(), time.perf_counter()
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            with contextlib.suppress(OSError):
                for line in self.path.read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        self.now_kib = int(line.split()[1])
                        self._peak = max(self._peak, self.now_kib)

    def reset(self) -> None:
        self._peak = self.now_kib
        self._cpu_at, self._wall_at = self._cpu_s(), time.perf_counter()

    def _cpu_s(self) -> float:
        """The process's user + system CPU seconds so far."""
        fields = self.path.with_name("stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def cpu_share(self) -> float:
        """The share of one core the process used since the last ``reset()``."""
        return (self._cpu_s() - self._cpu_at) / (time.perf_counter() - self._wall_at)

    def peak_mib(self) -> float:
        return self._peak / 1024

    def close(self) -> None:
        self._stop.set()


async def _metrics(session: Any, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("fracgpu_admission_") and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            if "_bucket" not in name:
                out[name] = float(value)
    return out


def _row(phase: str, result: Result, rss: Rss, stalls: dict[str, Any]) -> dict[str, Any]:
    return {
        "loop_stalls": stalls,
        "phase": phase,
        "requests": result.requests,
        "errors": result.errors,
        "p50_ms": round(result.p50_ms, 2),
        "p99_ms": round(result.p99_ms, 2),
        "max_ms": round(max(result.latencies) * 1000, 2) if result.latencies else float("nan"),
        "peak_rss_mib": round(rss.peak_mib(), 1),
        "rss_at_end_mib": round(rss.now_kib / 1024, 1),
        "server_cpu": round(rss.cpu_share(), 2),
    }


async def _conduct(
    args: argparse.Namespace, port: int, ca: str, server_pid: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    import aiohttp

    url = f"https://127.0.0.1:{port}"
    context = ssl.create_default_context(cadata=ca)
    body = EXAMPLE.read_bytes()
    rss = Rss(server_pid)
    rows: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=args.connections, ssl=context)
    ) as session:

        async def send() -> None:
            async with session.post(
                url + "/mutate", data=body, headers={"Content-Type": "application/json"}
            ) as resp:
                reply = await resp.read()
                if resp.status != 200 or b'"allowed":true' not in reply.replace(b" ", b""):
                    raise RuntimeError(resp.status)

        async def stalls() -> dict[str, Any]:
            async with session.get(url + "/bench/stalls") as resp:
                summary: dict[str, Any] = await resp.json()
                return summary

        await open_loop(send, args.rate, 1.0)  # warm up
        await asyncio.sleep(0.5)
        rss.reset()
        await stalls()
        rows.append(
            _row("baseline", await open_loop(send, args.rate, args.seconds), rss, await stalls())
        )
        extra["rss_before_abuse_mib"] = round(rss.now_kib / 1024, 1)

        ctx = multiprocessing.get_context("spawn")
        stop, report = ctx.Event(), ctx.Queue()
        abuser = ctx.Process(target=_abuser_main, args=(port, ca, args, stop, report))
        abuser.start()
        rss.reset()
        await stalls()
        ramp_probe = asyncio.ensure_future(
            open_loop(send, args.rate, args.idle / args.ramp_rate + 2.0)
        )
        ramped = await asyncio.to_thread(report.get, True, args.idle / args.ramp_rate + 120)
        rows.append(_row("ramp", await ramp_probe, rss, await stalls()))
        rss.reset()
        rows.append(
            _row("abuse", await open_loop(send, args.rate, args.seconds), rss, await stalls())
        )
        extra["server_metrics_under_abuse"] = await _metrics(session, url)
        stop.set()
        done = await asyncio.to_thread(report.get, True, 60)
        abuser.join(30)
        extra["abuser"] = {**ramped, **done}
        await asyncio.sleep(args.settle)
        rss.reset()
        await stalls()
        rows.append(
            _row("after", await open_loop(send, args.rate, args.seconds), rss, await stalls())
        )
        extra["server_metrics_after"] = await _metrics(session, url)
    rss.close()
    return rows, extra


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.webhook_abuse", description=__doc__)
    parser.add_argument("--idle", type=int, default=2000, help="idle TLS connections to open")
    parser.add_argument("--ramp-rate", type=float, default=200.0, help="idle opens per second")
    parser.add_argument("--bodies", type=int, default=40, help="concurrent large-body senders")
    parser.add_argument("--body-mib", type=int, default=8)
    parser.add_argument(
        "--dense",
        action="store_true",
        help="large bodies of one-digit numbers (the costliest to parse) instead of env vars",
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="per measured phase")
    parser.add_argument("--settle", type=float, default=5.0, help="wait before 'after'")
    parser.add_argument("--rate", type=float, default=100.0, help="ordinary reviews per second")
    parser.add_argument("--connections", type=int, default=4, help="prober's connection pool")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(args.serve, args.dir))
        return 0

    with server_process("bench.webhook_abuse") as served:
        rows, extra = asyncio.run(_conduct(args, served.port, served.ca_pem.decode(), served.pid))
    print(
        f"fracgpu webhook under abuse: {args.idle} idle TLS connections + {args.bodies} senders "
        f"of {args.body_mib} MiB{' dense' if args.dense else ''} bodies; "
        f"ordinary GPU-pod reviews at {args.rate:g}/s, "
        f"{args.seconds:g} s per phase ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, "
        f"MALLOC_ARENA_MAX={os.environ.get('MALLOC_ARENA_MAX', 'unset')})"
    )
    print(
        f"{'phase':9} {'reqs':>6} {'errors':>6} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} "
        f"{'peak RSS MiB':>12} {'RSS at end':>10}"
    )
    for r in rows:
        print(
            f"{r['phase']:9} {r['requests']:6d} {r['errors']:6d} {r['p50_ms']:7.2f} "
            f"{r['p99_ms']:7.2f} {r['max_ms']:7.2f} {r['peak_rss_mib']:12.1f} "
            f"{r['rss_at_end_mib']:10.1f} {r['server_cpu']:5.2f}  "
            f"{r['loop_stalls']['over_5ms']:5d} / {r['loop_stalls']['over_10ms']:5d} / "
            f"{r['loop_stalls']['max_ms']:.1f} ms  {r['loop_stalls']['full_gcs']} "
            f"({r['loop_stalls']['full_gc_max_ms']:.1f} ms)"
        )
    abuser = extra["abuser"]
    print(
        f"abuser: opened {abuser['opened']} idle connections ({abuser['failed']} failed), "
        f"{abuser['open']} still open after the ramp, {abuser['open_at_end']} at the end; "
        f"large bodies: {abuser['bodies']}"
    )
    under = extra["server_metrics_under_abuse"]
    print(
        "server under abuse: "
        + ", ".join(
            f"{k}={v:g}" for k, v in sorted(under.items()) if "connections" in k or "refused" in k
        )
    )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, **extra}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
