"""`fracgpu serve` in a cluster: the real client against the fake API server, real TLS."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import jsonpatch
import pytest

from certs.config import CertsConfig
from fracgpu.serve import ServeConfig, _until_stopped, run_server
from quota.config import QuotaConfig
from testkit.apiserver import FakeApiServer
from tests.serving import in_cluster_config, issued_ca
from tests.support import eventually, free_port
from webhook.config import AdmissionConfig, ServerConfig

EXAMPLE = Path(__file__).parent.parent / "examples" / "admissionreview-pod.json"


def _counted(quota: dict[str, Any] | None) -> bool:
    conditions = ((quota or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Counted" and c["status"] == "True" for c in conditions)


async def _ready(http: aiohttp.ClientSession, url: str) -> bool:
    """Whether the server answers /readyz with 200 within 4 s."""
    for _ in range(200):
        with contextlib.suppress(aiohttp.ClientConnectionError):  # not listening yet
            async with http.get(url + "/readyz") as resp:
                if resp.status == 200:
                    return True
        await asyncio.sleep(0.02)
    return False


@contextlib.asynccontextmanager
async def _in_cluster(
    fake: FakeApiServer, tmp_path: Path, admission: AdmissionConfig
) -> AsyncIterator[tuple[aiohttp.ClientSession, str]]:
    """``fracgpu serve`` against the fake cluster, ready, with a client that trusts the CA it
    issued into its Secret; stopped at the end, which must be a clean exit."""
    port = free_port()
    config = in_cluster_config(fake, tmp_path, port, admission)
    stop = asyncio.Event()
    server = asyncio.ensure_future(run_server(config, standalone=False, stop=stop))
    ctx = await issued_ca(fake)
    url = f"https://127.0.0.1:{port}"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as http:
        assert await _ready(http, url)
        yield http, url
    stop.set()
    assert await asyncio.wait_for(server, 10) == 0


async def test_serve_in_cluster_sizes_pods_from_node_labels(tmp_path: Path) -> None:
    async with FakeApiServer() as fake:
        for ns in ("fracgpu", "team-a"):
            fake.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        fake.put(
            {
                "apiVersion": "fracgpu.io/v1",
                "kind": "GPUQuota",
                "metadata": {"name": "team-a", "namespace": "team-a"},
                "spec": {"gpu": "0.25"},
            }
        )
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
        async with _in_cluster(fake, tmp_path, AdmissionConfig()) as (http, url):
            # The quota controller counts the new GPUQuota before admission uses it.
            await eventually(lambda: _counted(fake.get("gpuquotas", "team-a", "team-a")))
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
            assert patch[0]["value"]["limits"] == {
                "fracgpu.io/core": "30",
                "fracgpu.io/memory": "26",
            }
            # The validating side sees the mutated pod and checks it against the GPUQuota.
            validate = copy.deepcopy(review)
            pod = jsonpatch.apply_patch(review["request"]["object"], patch)
            pod["metadata"]["uid"] = "pod-uid-1"
            validate["request"]["object"] = pod
            async with http.post(url + "/validate", json=validate) as resp:
                verdict = (await resp.json())["response"]
        assert verdict["allowed"] is False
        assert verdict["status"]["message"].startswith(
            'GPU quota exceeded in namespace "team-a": this pod asks 0.30 card'
        )


async def test_standalone_serves_mutate_and_validate_until_stopped(tmp_path: Path) -> None:
    """What `make run` starts: local certificates, embedded quota, no cluster."""
    port = free_port()
    config = ServeConfig(
        server=ServerConfig(host="127.0.0.1", port=port),
        certs=CertsConfig(mode="directory", directory=tmp_path / "certs"),
        quota=QuotaConfig(mode="embedded"),
        shutdown_delay_seconds=0,
    )
    stop = asyncio.Event()
    server = asyncio.ensure_future(run_server(config, standalone=True, stop=stop))
    await eventually(lambda: (tmp_path / "certs" / "ca-bundle.crt").exists() or server.done())
    ctx = ssl.create_default_context(cafile=str(tmp_path / "certs" / "ca-bundle.crt"))
    url = f"https://127.0.0.1:{port}"
    review = json.loads(EXAMPLE.read_text())
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as http:
        assert await _ready(http, url)
        await asyncio.sleep(0.3)  # background jobs that finish early must not stop the server
        assert not server.done()
        for path in ("/mutate", "/validate"):
            async with http.post(url + path, json=review) as resp:
                assert (await resp.json())["response"]["allowed"] is True
    stop.set()
    assert await asyncio.wait_for(server, 10) == 0


async def _finishes() -> None:
    """A job that has nothing to do, as the embedded quota controller."""


async def _fails() -> None:
    raise RuntimeError("the job broke")


async def _forever() -> None:
    await asyncio.Event().wait()


@pytest.mark.parametrize(
    ("jobs", "stop_after_s", "status"),
    [
        pytest.param([_forever], 0.05, 0, id="stop event: clean exit"),
        pytest.param([_finishes, _forever], 0.05, 0, id="a job that returns keeps serving"),
        pytest.param([_finishes], 0.05, 0, id="every job returned: serve until stopped"),
        pytest.param([_forever, _fails], None, 1, id="a failing job stops the server"),
    ],
)
async def test_supervision_of_background_jobs(
    jobs: list[Callable[[], Awaitable[None]]], stop_after_s: float | None, status: int
) -> None:
    stop = asyncio.Event()
    if stop_after_s is not None:
        asyncio.get_running_loop().call_later(stop_after_s, stop.set)
    result = await asyncio.wait_for(_until_stopped([job() for job in jobs], stop), 5)
    assert result == status


async def test_serve_in_dra_mode_sizes_claims_from_resource_slices(tmp_path: Path) -> None:
    async with FakeApiServer() as fake:
        for ns in ("fracgpu", "team-a"):
            fake.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        device = {
            "name": "gpu-0",
            "attributes": {"productName": {"string": "NVIDIA-L4"}},
            "capacity": {"cores": {"value": "100"}, "memory": {"value": "22784Mi"}},
        }
        fake.put(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceSlice",
                "metadata": {"name": "gpu-1-gpu.fracgpu.io"},
                "spec": {
                    "driver": "gpu.fracgpu.io",
                    "nodeName": "gpu-1",
                    "pool": {"name": "gpu-1", "generation": 1, "resourceSliceCount": 1},
                    "devices": [device],
                },
            }
        )
        fake.put(
            {
                "apiVersion": "fracgpu.io/v1",
                "kind": "GPUQuota",
                "metadata": {"name": "team-a", "namespace": "team-a"},
                "spec": {"gpu": "0.25"},
            }
        )
        async with _in_cluster(fake, tmp_path, AdmissionConfig(allocation="dra")) as (http, url):
            review = json.loads(EXAMPLE.read_text())
            container = review["request"]["object"]["spec"]["containers"][0]
            container["resources"] = {"limits": {"fracgpu.io/gpu": "0.5"}}
            review["request"]["namespace"] = "team-a"
            async with http.post(url + "/mutate", json=review) as resp:
                reply = (await resp.json())["response"]
            # Quota counts the claim the mutated pod holds: half a card, over a 0.25 quota.
            await eventually(lambda: _counted(fake.get("gpuquotas", "team-a", "team-a")))
            validate = copy.deepcopy(review)
            pod = jsonpatch.apply_patch(
                review["request"]["object"], json.loads(base64.b64decode(reply["patch"]))
            )
            pod["metadata"].update(uid="pod-uid-dra", namespace="team-a")
            validate["request"]["object"] = pod
            async with http.post(url + "/validate", json=validate) as resp:
                verdict = (await resp.json())["response"]
            # A dry run makes no template; quota counts it from what this replica planned.
            dry = copy.deepcopy(review)
            dry["request"]["dryRun"] = True
            dry["request"]["object"]["spec"]["containers"][0]["resources"] = {
                "limits": {"fracgpu.io/gpu": "2"}
            }
            async with http.post(url + "/mutate", json=dry) as resp:
                dry_reply = (await resp.json())["response"]
            dry_pod = jsonpatch.apply_patch(
                dry["request"]["object"], json.loads(base64.b64decode(dry_reply["patch"]))
            )
            dry_pod["metadata"].update(uid="pod-uid-dry", namespace="team-a")
            dry["request"]["object"] = dry_pod
            async with http.post(url + "/validate", json=dry) as resp:
                dry_verdict = (await resp.json())["response"]
    assert reply["allowed"] is True
    patch = json.loads(base64.b64decode(reply["patch"]))
    [claims] = [op["value"] for op in patch if op["path"] == "/spec/resourceClaims"]
    [template] = fake.objects("resourceclaimtemplates", "team-a")
    assert claims == [{"name": "gpu-0", "resourceClaimTemplateName": template["metadata"]["name"]}]
    [request] = template["spec"]["spec"]["devices"]["requests"]
    [alternative] = request["firstAvailable"]
    # Half of the L4 the slice publishes: 89 blocks, floor(89 / 2) = 44 (11264Mi, which the API
    # server stores in its canonical form).
    assert alternative["capacity"]["requests"] == {"cores": "50", "memory": "11Gi"}
    assert verdict["allowed"] is False
    assert verdict["status"]["message"].startswith(
        'GPU quota exceeded in namespace "team-a": this pod asks 0.50 card and 11264 MiB'
    )
    assert fake.get("resourceclaimtemplates", "fracgpu-cards-2", "team-a") is None
    assert dry_verdict["allowed"] is False
    assert dry_verdict["status"]["message"].startswith(
        'GPU quota exceeded in namespace "team-a": this pod asks 2.00 cards'
    )
