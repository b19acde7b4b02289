"""`fracgpu serve` in a cluster: the real client against the fake API server, real TLS."""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
from pathlib import Path

import aiohttp

from certs.config import CertsConfig
from tests.fakes.apiserver import FakeApiServer
from tests.support import eventually
from webhook.config import AdmissionConfig, ServerConfig
from webhook.serve import ServeConfig, run_server

EXAMPLE = Path(__file__).parent.parent / "examples" / "admissionreview-pod.json"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_serve_in_cluster_sizes_pods_from_node_labels(tmp_path: Path) -> None:
    async with FakeApiServer() as fake:
        fake.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "fracgpu"}})
        fake.put(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": "gpu-1",
                    "labels": {
                        "fracgpu.io/gpu.product": "NVIDIA-L4",
                        "fracgpu.io/gpu.memory-mib": "23034",
                    },
                },
            }
        )
        port = free_port()
        config = ServeConfig(
            server=ServerConfig(host="127.0.0.1", port=port),
            admission=AdmissionConfig(),
            certs=CertsConfig(
                mode="secret",
                namespace="fracgpu",
                hosts=["127.0.0.1"],
                ips=["127.0.0.1"],
                inject=False,
            ),
            kubeconfig=fake.kubeconfig(tmp_path / "kubeconfig"),
            shutdown_delay_seconds=0,
        )
        stop = asyncio.Event()
        server = asyncio.ensure_future(run_server(config, standalone=False, stop=stop))
        await eventually(lambda: fake.get("secrets", "fracgpu-webhook-tls", "fracgpu") is not None)
        secret = fake.get("secrets", "fracgpu-webhook-tls", "fracgpu")
        assert secret is not None
        bundle = base64.b64decode(secret["data"]["ca-bundle.crt"]).decode()
        ctx = ssl.create_default_context(cadata=bundle)
        url = f"https://127.0.0.1:{port}"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as http:
            ready = False
            for _ in range(200):
                try:
                    async with http.get(url + "/readyz") as resp:
                        if resp.status == 200:
                            ready = True
                            break
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.02)
            assert ready
            review = json.loads(EXAMPLE.read_text())
            del review["request"]["object"]["spec"]["containers"][0]["resources"]["limits"][
                "fracgpu.io/gpumem"
            ]
            del review["request"]["object"]["spec"]["containers"][0]["resources"]["requests"][
                "fracgpu.io/gpumem"
            ]
            async with http.post(url + "/mutate", json=review) as resp:
                reply = await resp.json()
        patch = json.loads(base64.b64decode(reply["response"]["patch"]))
        # 0.3 of an L4 (the only model the nodes report): floor(89 * 30 / 100) blocks.
        assert patch[0]["value"]["limits"] == {"fracgpu.io/core": "30", "fracgpu.io/memory": "26"}
        stop.set()
        assert await asyncio.wait_for(server, 10) == 0
