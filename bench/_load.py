"""Load generation shared by the HTTP benchmarks: closed-loop throughput, open-loop latency.

Closed loop (N workers, each sending the next request when the last returns) finds the
throughput ceiling. Open loop (requests started on a fixed schedule, latency measured from the
*scheduled* start) gives latency at a given rate without coordinated omission: a stall delays
every request scheduled behind it, and that shows in p99.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

Send = Callable[[], Awaitable[None]]


@dataclass
class Result:
    requests: int
    errors: int
    seconds: float
    latencies: list[float]

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def percentile(self, p: float) -> float:
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]

    @property
    def p50_ms(self) -> float:
        return statistics.median(self.latencies) * 1000 if self.latencies else float("nan")

    @property
    def p99_ms(self) -> float:
        return self.percentile(99) * 1000


async def closed_loop(send: Send, workers: int, seconds: float) -> Result:
    deadline = time.perf_counter() + seconds
    latencies: list[float] = []
    errors = 0

    async def worker() -> None:
        nonlocal errors
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            try:
                await send()
            except Exception:
                errors += 1
                continue
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(workers)))
    return Result(len(latencies), errors, time.perf_counter() - started, latencies)


async def open_loop(send: Send, rate: float, seconds: float) -> Result:
    latencies: list[float] = []
    errors = 0
    interval = 1.0 / rate
    count = int(rate * seconds)
    start = time.perf_counter() + 0.05

    async def one(scheduled: float) -> None:
        nonlocal errors
        try:
            await send()
        except Exception:
            errors += 1
            return
        latencies.append(time.perf_counter() - scheduled)

    tasks = []
    for i in range(count):
        scheduled = start + i * interval
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(scheduled)))
    await asyncio.gather(*tasks)
    return Result(len(latencies), errors, time.perf_counter() - start, latencies)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for the benchmark's server process."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class Served:
    port: int
    ca_pem: bytes  # what clients must trust
    pid: int


@contextlib.contextmanager
def server_process(module: str) -> Iterator[Served]:
    """Runs a benchmark's server as ``python -m MODULE --serve PORT --dir DIR`` in its own
    process, with a CA issued here into DIR, until the block ends. The server prints ``ready``
    once it listens."""
    from certs.config import CertsConfig
    from certs.serving import open_serving

    with tempfile.TemporaryDirectory() as tmp:
        certs = asyncio.run(
            open_serving(CertsConfig(mode="directory", directory=Path(tmp)), standalone=True)
        )
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
        server = subprocess.Popen(
            [sys.executable, "-m", module, "--serve", str(port), "--dir", tmp],
            stdout=subprocess.PIPE,
            env=env,
        )
        try:
            assert server.stdout is not None
            if server.stdout.readline().strip() != b"ready":
                raise RuntimeError(f"benchmark server {module} did not start")
            yield Served(port, certs.ca_bundle_pem(), server.pid)
        finally:
            server.terminate()
            server.wait(10)
