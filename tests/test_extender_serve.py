"""The extender inside ``fracgpu serve``: the scheduler's three calls over mutual TLS (the
extender's own port, the client certificate serve issues) against the fake API server, and
reclaim as soon as the pod is gone (its watch event triggers the pass; the periodic pass is an
hour away)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from core.placement import PLACEMENT_ANNOTATION, parse
from extender.service import BIND_PATH, FILTER_PATH, PRIORITIZE_PATH, ExtenderConfig
from fracgpu.serve import run_server
from testkit.apiserver import FakeApiServer
from testkit.extender import Gpu, node, pod
from testkit.kinds import GPUNODELEDGER
from tests.serving import in_cluster_config, issued_ca
from tests.support import eventually, free_port

CLIENT_SECRET = ("secrets", "fracgpu-scheduler-client-tls", "fracgpu")


@contextlib.asynccontextmanager
async def serving(
    fake: FakeApiServer, tmp_path: Path
) -> AsyncIterator[tuple[aiohttp.ClientSession, str]]:
    port, extender = free_port(), free_port()
    config = in_cluster_config(fake, tmp_path, port).model_copy(
        update={
            "extender": ExtenderConfig(enabled=True, reclaim_interval_seconds=3600, port=extender)
        }
    )
    stop = asyncio.Event()
    server = asyncio.ensure_future(run_server(config, standalone=False, stop=stop))
    ctx = await issued_ca(fake)
    # The extender's own port, with the client certificate serve issues for the scheduler
    # (tests/test_extender_listener.py: without it, the port refuses).
    await eventually(lambda: fake.get(*CLIENT_SECRET) is not None)
    client = fake.get(*CLIENT_SECRET)
    assert client is not None
    for key in ("tls.crt", "tls.key"):
        (tmp_path / key).write_bytes(base64.b64decode(client["data"][key]))
    ctx.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    url = f"https://127.0.0.1:{extender}"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as http:
        yield http, url
    stop.set()
    assert await asyncio.wait_for(server, 10) == 0


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    for _ in range(200):
        with contextlib.suppress(aiohttp.ClientConnectionError):  # not listening yet
            async with http.post(url, json=body) as resp:
                return resp.status, await resp.json()
        await asyncio.sleep(0.02)
    raise AssertionError(f"{url} never answered")


async def test_filter_prioritize_bind_and_reclaim(tmp_path: Path) -> None:
    async with FakeApiServer(namespaces=("default", "fracgpu", "team")) as fake:
        fake.register(GPUNODELEDGER)
        fake.put(node("n1", Gpu("GPU-1"), Gpu("GPU-2")))
        fake.put(node("n2", Gpu("GPU-3", healthy=False)))
        fake.put(pod("a", (50, 32)))
        args = {"Pod": fake.get("pods", "a", "team"), "NodeNames": ["n1", "n2"]}
        async with serving(fake, tmp_path) as (http, url):

            async def filtered() -> Any:
                status, reply = await post(http, url + FILTER_PATH, args)
                assert status == 200
                return reply

            reply = await filtered()
            for _ in range(200):  # until the caches have listed
                if not reply["Error"]:
                    break
                await asyncio.sleep(0.02)
                reply = await filtered()
            assert reply["NodeNames"] == ["n1"]
            assert list(reply["FailedAndUnresolvableNodes"]) == ["n2"]

            status, scores = await post(http, url + PRIORITIZE_PATH, args)
            assert status == 200
            assert [s["Host"] for s in scores] == ["n1", "n2"]
            assert scores[1]["Score"] == 0

            bind = {"PodName": "a", "PodNamespace": "team", "PodUID": "uid-a", "Node": "n1"}
            status, answer = await post(http, url + BIND_PATH, bind)
            assert (status, answer) == (200, {"Error": ""})
            bound = fake.get("pods", "a", "team")
            assert bound is not None and bound["spec"]["nodeName"] == "n1"
            record = parse(bound["metadata"]["annotations"][PLACEMENT_ANNOTATION], pod="a")
            assert record.containers["c0"].cards == ("GPU-1",)

            status, refused = await post(http, url + BIND_PATH, {"PodName": "a"})
            assert status == 400 and "bad extender request" in refused["Error"]

            fake.remove("pods", "a", "team")

            def released() -> bool:
                ledger = fake.get("gpunodeledgers", "n1")
                return ledger is not None and not ledger["spec"]["bookings"]

            await eventually(released)
