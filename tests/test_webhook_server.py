"""The admission server over real HTTPS, fed what kube-apiserver sends.

The client verifies the server certificate against the CA the project issued, as the apiserver
does with the caBundle; every reply is checked the way ``VerifyAdmissionResponse`` checks it,
and every patch is applied to the object that was sent.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import gc
import json
import logging
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import jsonpatch
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from certs.config import CertsConfig
from certs.serving import open_serving
from core.admission import AdmissionRequest, AdmissionResponse
from tests.support import eventually
from webhook.bodies import (
    LARGE_BODY_BYTES,
    MAX_PIECE_BYTES,
    MIN_PIECE_BYTES,
    LoopShare,
    _next_piece,
)
from webhook.config import AdmissionConfig, ServerLimits
from webhook.inventory import Inventory
from webhook.metrics import AdmissionMetrics
from webhook.mutation import Mutator
from webhook.server import build_app
from webhook.transport import LINGER_S, _Connection, listen

EXAMPLE = json.loads(
    (Path(__file__).parent.parent / "examples" / "admissionreview-pod.json").read_text()
)


@dataclass
class Server:
    url: str
    session: aiohttp.ClientSession
    metrics: AdmissionMetrics
    port: int
    client_ctx: ssl.SSLContext
    release: asyncio.Event  # lets reviews on /hold finish

    async def post(
        self, path: str, body: Any, *, raw: bytes | None = None
    ) -> aiohttp.ClientResponse:
        data = raw if raw is not None else json.dumps(body).encode()
        resp = await self.session.post(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        await resp.read()
        return resp

    async def review(self, body: dict[str, Any], path: str = "/mutate") -> dict[str, Any]:
        resp = await self.post(path, body)
        assert resp.status == 200
        reply = await resp.json()
        # What kube-apiserver verifies before it trusts a reply (design K1).
        assert reply["apiVersion"] == body["apiVersion"]
        assert reply["kind"] == "AdmissionReview"
        response: dict[str, Any] = reply["response"]
        assert response["uid"] == body["request"]["uid"]
        assert ("patch" in response) == ("patchType" in response)
        if "patchType" in response:
            assert response["patchType"] == "JSONPatch"
        return response


async def boom(req: AdmissionRequest) -> AdmissionResponse:
    raise RuntimeError("reviewer bug")


@contextlib.asynccontextmanager
async def running(directory: Path, limits: ServerLimits | None = None) -> AsyncIterator[Server]:
    """The admission app served by ``listen`` (the production path) on a free loopback port."""
    certs = await open_serving(CertsConfig(mode="directory", directory=directory), standalone=True)
    metrics = AdmissionMetrics(CollectorRegistry())
    mutator = Mutator(AdmissionConfig(), Inventory({"NVIDIA-H100-80GB-HBM3": 81559}))
    release = asyncio.Event()

    async def hold(req: AdmissionRequest) -> AdmissionResponse:
        await release.wait()
        return AdmissionResponse.allow(req.uid)

    reviewers = {"/mutate": mutator, "/boom": boom, "/hold": hold}
    app = build_app(reviewers, metrics=metrics, limits=limits)
    listener = await listen(app, "127.0.0.1", 0, certs.context)
    client_ctx = ssl.create_default_context(cadata=certs.ca_bundle_pem().decode())
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=client_ctx))
    try:
        url = f"https://127.0.0.1:{listener.port}"
        yield Server(url, session, metrics, listener.port, client_ctx, release)
    finally:
        await session.close()
        await listener.close()


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    async with running(tmp_path) as s:
        yield s


def patched(body: dict[str, Any], response: dict[str, Any], key: str = "object") -> Any:
    ops = json.loads(base64.b64decode(response["patch"]))
    return jsonpatch.apply_patch(body["request"][key], ops)


async def test_kubectl_pod_create(server: Server) -> None:
    response = await server.review(EXAMPLE)
    assert response["allowed"] is True
    pod = patched(EXAMPLE, response)
    container = pod["spec"]["containers"][0]
    assert container["resources"] == {
        "limits": {"fracgpu.io/core": "30", "fracgpu.io/memory": "32"},
        "requests": {"fracgpu.io/core": "30", "fracgpu.io/memory": "32"},
    }
    # admission.scheduler_name is empty by default: the pod keeps the scheduler it names.
    assert pod["spec"]["schedulerName"] == "default-scheduler"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"][
        "tolerations"
    ]
    # The reply is idempotent under reinvocation.
    again = copy.deepcopy(EXAMPLE)
    again["request"]["object"] = pod
    assert "patch" not in await server.review(again)


async def test_pod_from_replicaset_has_no_name_or_namespace(server: Server) -> None:
    body = copy.deepcopy(EXAMPLE)
    req = body["request"]
    req["name"] = ""
    req["userInfo"] = {"username": "system:serviceaccount:kube-system:replicaset-controller"}
    meta = req["object"]["metadata"]
    meta.pop("name")
    meta.pop("namespace")
    meta["generateName"] = "inference-7d9f8-"
    meta["ownerReferences"] = [
        {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "name": "inference-7d9f8",
            "uid": "x",
            "controller": True,
        }
    ]
    response = await server.review(body)
    pod = patched(body, response)
    assert pod["metadata"]["generateName"] == "inference-7d9f8-"
    assert "fracgpu.io/request" in pod["metadata"]["annotations"]


def deployment_review(operation: str) -> dict[str, Any]:
    template = copy.deepcopy(EXAMPLE["request"]["object"])
    template["metadata"] = {"labels": {"app": "inference"}}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "inference", "namespace": "team-a"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "inference"}},
            "template": template,
        },
    }
    body = copy.deepcopy(EXAMPLE)
    body["request"].update(
        kind={"group": "apps", "version": "v1", "kind": "Deployment"},
        resource={"group": "apps", "version": "v1", "resource": "deployments"},
        name="inference",
        operation=operation,
        object=deployment,
        oldObject=copy.deepcopy(deployment) if operation == "UPDATE" else None,
    )
    return body


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE"])
async def test_deployment(server: Server, operation: str) -> None:
    body = deployment_review(operation)
    response = await server.review(body)
    deployment = patched(body, response)
    limits = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"fracgpu.io/core": "30", "fracgpu.io/memory": "32"}


async def test_dry_run_gets_the_same_answer(server: Server) -> None:
    body = copy.deepcopy(EXAMPLE)
    body["request"]["dryRun"] = True
    assert (await server.review(body))["patch"] == (await server.review(EXAMPLE))["patch"]


async def test_v1beta1_is_answered_in_v1beta1(server: Server) -> None:
    body = copy.deepcopy(EXAMPLE)
    body["apiVersion"] = "admission.k8s.io/v1beta1"
    response = await server.review(body)
    assert response["allowed"] is True
    assert "patch" in response


async def test_denial_message_and_status(server: Server) -> None:
    body = copy.deepcopy(EXAMPLE)
    resources = body["request"]["object"]["spec"]["containers"][0]["resources"]
    resources["limits"] = resources["requests"] = {"fracgpu.io/gpu": "1500m"}
    response = await server.review(body)
    assert response["allowed"] is False
    assert response["status"] == {
        "status": "Failure",
        "reason": "Invalid",
        "code": 422,
        "message": 'container "jupyter": fracgpu.io/gpu must be a fraction between 0.01 and 1 '
        "with at most two decimals, or a whole number of cards; got 1.5",
    }
    assert "patch" not in response


async def test_internal_error_fails_closed_with_http_200(server: Server) -> None:
    response = await server.review(EXAMPLE, path="/boom")
    assert response["allowed"] is False
    assert response["status"]["reason"] == "InternalError"
    assert EXAMPLE["request"]["uid"] in response["status"]["message"]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"", "not an AdmissionReview"),
        (b"not json", "not an AdmissionReview"),
        (b"[]", "not an AdmissionReview"),
        (
            b'{"apiVersion":"admission.k8s.io/v2","kind":"AdmissionReview"}',
            "unsupported apiVersion",
        ),
        (b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}', "request is missing"),
        (
            b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":""}}',
            "request.uid",
        ),
    ],
    ids=["empty body", "not JSON", "a JSON array", "admission v2", "no request", "an empty uid"],
)
@pytest.mark.parametrize("size", ["ordinary", "large"])
async def test_malformed_bodies_get_400(
    server: Server, raw: bytes, expected: str, size: str
) -> None:
    if size == "large":  # parsed in pieces as it arrives (JSON allows trailing whitespace)
        raw = raw.ljust(LARGE_BODY_BYTES + 1)
    resp = await server.post("/mutate", None, raw=raw)
    assert resp.status == 400
    assert expected in (await resp.json())["error"]


async def test_a_large_body_gets_the_answer_its_pod_would_get_small(server: Server) -> None:
    raw = json.dumps(EXAMPLE).encode()
    small = await server.post("/mutate", None, raw=raw)
    large = await server.post("/mutate", None, raw=raw.ljust(3 * LARGE_BODY_BYTES))
    assert (large.status, await large.json()) == (200, await small.json())


async def test_large_pods_fit_and_oversized_bodies_are_refused(server: Server) -> None:
    body = copy.deepcopy(EXAMPLE)
    container = body["request"]["object"]["spec"]["containers"][0]
    container["env"] = [{"name": f"VAR_{i}", "value": "x" * 1000} for i in range(3500)]
    assert len(json.dumps(body)) > 3 * 2**20
    assert (await server.review(body))["allowed"] is True
    resp = await server.post("/mutate", None, raw=b" " * (9 * 2**20))
    assert resp.status == 413


async def test_health_readiness_and_metrics(server: Server) -> None:
    await server.review(EXAMPLE)
    for path in ("/healthz", "/readyz"):
        async with server.session.get(server.url + path) as resp:
            assert resp.status == 200
    async with server.session.get(server.url + "/metrics") as resp:
        text = await resp.text()
    assert (
        'fracgpu_admission_reviews_total{endpoint="/mutate",outcome="allowed",reason="gpu"} 1.0'
        in text
    )
    assert "fracgpu_admission_duration_seconds_bucket" in text


async def test_plain_http_is_refused(server: Server) -> None:
    plain = server.url.replace("https://", "http://")
    with pytest.raises(aiohttp.ClientError):
        async with aiohttp.ClientSession() as s, s.get(plain + "/healthz") as resp:
            await resp.read()


fuzz_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=10), c, max_size=3),
    max_leaves=12,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    mutation=st.lists(
        st.tuples(
            st.sampled_from(
                [
                    "apiVersion",
                    "kind",
                    "request",
                    "uid",
                    "operation",
                    "object",
                    "dryRun",
                    "spec",
                    "metadata",
                    "containers",
                ]
            ),
            fuzz_values,
        ),
        max_size=4,
    ),
    junk=st.binary(max_size=64),
)
async def test_fuzzed_bodies_never_get_a_500(
    server: Server, mutation: list[tuple[str, Any]], junk: bytes
) -> None:
    body = copy.deepcopy(EXAMPLE)
    targets = [body, body["request"], body["request"]["object"], body["request"]["object"]["spec"]]
    for i, (key, value) in enumerate(mutation):
        targets[i % len(targets)][key] = value
    for raw in (json.dumps(body).encode(), junk):
        resp = await server.post("/mutate", None, raw=raw)
        assert resp.status in (200, 400), resp.status


# --- What a client can hold -------------------------------------------------------------------
#
# Small limits and counts: the rules are the same at 4 connections as at 256, and this machine
# is shared. The 2,000-connection figures come from ``python -m bench.webhook_abuse``.

FAST = ServerLimits(
    handshake_timeout_seconds=0.2,
    header_timeout_seconds=0.2,
    idle_timeout_seconds=0.3,
    body_timeout_seconds=0.3,
    max_body_bytes=64 * 1024,
    max_inflight_body_bytes=128 * 1024,
)
Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def tls(server: Server) -> Stream:
    return await asyncio.open_connection(
        "127.0.0.1", server.port, ssl=server.client_ctx, server_hostname="localhost"
    )


def head(length: int | None, path: str = "/mutate") -> bytes:
    size = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return f"POST {path} HTTP/1.1\r\nHost: localhost\r\n{size}\r\n\r\n".encode()


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """Whether the server closes the connection within ``seconds`` (anything it sends first,
    such as an error response, is read and dropped)."""
    try:
        async with asyncio.timeout(seconds):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return False
    except (ConnectionError, ssl.SSLError):
        pass
    return True


async def response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a Content-Length body: its status and body."""
    async with asyncio.timeout(5):
        header = await reader.readuntil(b"\r\n\r\n")
        lines = header.decode().split("\r\n")
        fields = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
        return int(lines[0].split()[1]), await reader.readexactly(int(fields["Content-Length"]))


def sample(server: Server, name: str, **labels: str) -> float:
    return server.metrics.registry.get_sample_value(name, labels) or 0.0


async def never_handshakes(server: Server) -> Stream:
    return await asyncio.open_connection("127.0.0.1", server.port)


async def never_sends_a_request(server: Server) -> Stream:
    return await tls(server)


async def trickles_headers(server: Server) -> Stream:
    reader, writer = await tls(server)

    async def trickle() -> None:
        writer.write(b"POST /mutate HTTP/1.1\r\n")
        with contextlib.suppress(ConnectionError, RuntimeError):
            for i in range(200):
                writer.write(f"X-Slow-{i}: x\r\n".encode())
                await writer.drain()
                await asyncio.sleep(0.02)

    asyncio.get_running_loop().create_task(trickle())
    return reader, writer


async def idles_after_a_request(server: Server) -> Stream:
    reader, writer = await tls(server)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert (await response(reader))[0] == 200
    return reader, writer


@pytest.mark.parametrize(
    "client",
    [
        pytest.param(never_handshakes, id="tcp-without-tls-handshake"),
        pytest.param(never_sends_a_request, id="tls-without-request"),
        pytest.param(trickles_headers, id="headers-trickled"),
        pytest.param(idles_after_a_request, id="idle-keep-alive"),
    ],
)
async def test_connections_that_send_nothing_useful_are_closed(
    tmp_path: Path, client: Callable[[Server], Awaitable[Stream]]
) -> None:
    async with running(tmp_path, FAST) as server:
        reader, writer = await client(server)
        try:
            assert await closed_within(reader, 3.0)
        finally:
            writer.close()


async def send_chunked_beyond_the_limit(writer: asyncio.StreamWriter) -> None:
    writer.write(head(None))
    chunk = b"x" * 16384
    for _ in range(6):
        writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
    writer.write(b"0\r\n\r\n")


async def send_a_slow_body(writer: asyncio.StreamWriter) -> None:
    writer.write(head(1000) + b'{"apiVersion":')


async def declare_too_much(writer: asyncio.StreamWriter) -> None:
    writer.write(head(64 * 1024 + 1))


@pytest.mark.parametrize(
    ("send", "status", "message"),
    [
        pytest.param(
            declare_too_much, 413, "server.limits.max_body_bytes", id="declared-too-large"
        ),
        pytest.param(
            send_chunked_beyond_the_limit,
            413,
            "server.limits.max_body_bytes",
            id="chunked-too-large",
        ),
        pytest.param(send_a_slow_body, 408, "server.limits.body_timeout_seconds", id="slow-body"),
    ],
)
async def test_bodies_beyond_the_limits_are_refused_with_a_status_that_says_which(
    tmp_path: Path,
    send: Callable[[asyncio.StreamWriter], Awaitable[None]],
    status: int,
    message: str,
) -> None:
    async with running(tmp_path, FAST) as server:
        reader, writer = await tls(server)
        try:
            await send(writer)
            got_status, body = await response(reader)
        finally:
            writer.close()
    assert (got_status, message in json.loads(body)["error"]) == (status, True)


async def test_the_connection_cap_keeps_the_api_servers_connections(tmp_path: Path) -> None:
    # Only the cap applies here: no timeout may close a connection while the flood connects.
    limits = ServerLimits(max_connections=4)
    async with running(tmp_path, limits) as server:
        pooled = await tls(server)  # an API server's connection: used, then idle in its pool
        pooled[1].write(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
        await response(pooled[0])
        mid_body = await tls(server)  # a request in progress when the flood comes
        raw = json.dumps(EXAMPLE).encode()
        mid_body[1].write(head(len(raw)) + raw[:100])
        await mid_body[1].drain()
        flood = [await tls(server) for _ in range(50)]
        await asyncio.sleep(0.05)
        open_now = sample(server, "fracgpu_admission_connections")
        mid_body[1].write(raw[100:])
        mid_status, _ = await response(mid_body[0])
        pooled[1].write(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
        pooled_status, _ = await response(pooled[0])
        fresh = await server.review(EXAMPLE)  # a new connection still gets in
        for _, writer in [pooled, mid_body, *flood]:
            writer.close()
    assert open_now == 4
    assert mid_status == 200
    assert pooled_status == 200
    assert fresh["allowed"] is True


async def test_at_the_cap_with_every_connection_busy_the_new_one_is_refused(
    tmp_path: Path,
) -> None:
    async with running(tmp_path, ServerLimits(max_connections=2)) as server:
        raw = json.dumps(EXAMPLE).encode()
        busy = [await tls(server) for _ in range(2)]
        for _, writer in busy:
            writer.write(head(len(raw)) + raw[:100])
            await writer.drain()
        # Both bodies are being read (each holds its share of the budget): both are busy.
        both = 2 * len(raw)
        await eventually(lambda: sample(server, "fracgpu_admission_inflight_body_bytes") == both)
        late_reader, late_writer = await tls(server)
        refused = await closed_within(late_reader, 3.0)
        late_writer.close()
        for _, writer in busy:
            writer.write(raw[100:])
        statuses = [(await response(reader))[0] for reader, _ in busy]
        for _, writer in busy:
            writer.close()
        counted = sample(server, "fracgpu_admission_connections_closed_total", reason="refused")
    assert refused
    assert counted == 1
    assert statuses == [200, 200]


async def test_large_bodies_cannot_take_the_room_of_ordinary_reviews(tmp_path: Path) -> None:
    limits = ServerLimits(
        max_body_bytes=2 * 2**20, max_inflight_body_bytes=4 * 2**20, body_timeout_seconds=0.5
    )
    large = json.dumps(EXAMPLE).encode().ljust(2 * 2**20)
    async with running(tmp_path, limits) as server:
        holder = await tls(server)  # a 2 MiB review still being answered: all the large share
        holder[1].write(head(len(large), "/hold") + large)
        await eventually(lambda: sample(server, "fracgpu_admission_inflight_body_bytes") > 0)
        second = await tls(server)  # a second large body waits for room, then gives up
        second[1].write(head(len(large)) + large)
        ordinary = await server.review(EXAMPLE)
        second_status, second_body = await response(second[0])
        server.release.set()
        holder_status, _ = await response(holder[0])
        for _, writer in (holder, second):
            writer.close()
    assert ordinary["allowed"] is True
    assert second_status == 503
    assert "max_inflight_body_bytes" in json.loads(second_body)["error"]
    assert holder_status == 200


async def test_large_bodies_are_let_in_at_their_rate(tmp_path: Path) -> None:
    limits = ServerLimits(
        max_body_bytes=2 * 2**20,
        max_inflight_body_bytes=64 * 2**20,
        large_body_bytes_per_second=2**20,
        body_timeout_seconds=0.5,
    )
    large = json.dumps(EXAMPLE).encode().ljust(2 * 2**20)
    async with running(tmp_path, limits) as server:
        statuses = []
        for _ in range(2):  # the second would have to wait 2 s for its turn
            reader, writer = await tls(server)
            writer.write(head(len(large)) + large)
            statuses.append((await response(reader))[0])
            writer.close()
        ordinary = await server.review(EXAMPLE)
    assert statuses == [200, 503]
    assert ordinary["allowed"] is True


@pytest.mark.parametrize("declared", [100_000, 4 * LARGE_BODY_BYTES], ids=["ordinary", "large"])
async def test_an_abandoned_body_logs_one_line_and_no_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, declared: int
) -> None:
    caplog.set_level(logging.DEBUG)
    async with running(tmp_path) as server:
        caplog.clear()
        _, writer = await tls(server)
        writer.write(head(declared) + b'{"a":' + b"[" * 100)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()
        await eventually(
            lambda: (
                sample(
                    server,
                    "fracgpu_admission_bodies_refused_total",
                    endpoint="/mutate",
                    reason="abandoned",
                )
                == 1
            )
        )
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == [
        "client abandoned its request body"
    ]
    assert [r for r in caplog.records if r.exc_info] == []


def test_the_body_budget_must_fit_a_largest_body() -> None:
    with pytest.raises(ValueError, match=r"at least twice server\.limits\.max_body_bytes"):
        ServerLimits(max_body_bytes=8 * 2**20, max_inflight_body_bytes=8 * 2**20)


async def refuse_by_declared_size(server: Server) -> Stream:
    reader, writer = await tls(server)
    writer.write(head(64 * 2**20))  # over max_body_bytes: 413 before a byte is read
    return reader, writer


async def refuse_as_not_json(server: Server) -> Stream:
    reader, writer = await tls(server)
    writer.write(head(32 * 2**20) + b"not json")  # 400 at the first piece
    return reader, writer


@pytest.mark.parametrize(
    ("refuse", "status"),
    [
        pytest.param(refuse_by_declared_size, 413, id="too-large"),
        pytest.param(refuse_as_not_json, 400, id="not-json"),
    ],
)
async def test_the_rest_of_a_large_body_answered_early_is_not_read(
    tmp_path: Path, refuse: Callable[[Server], Awaitable[Stream]], status: int
) -> None:
    """The client gets the answer while it still sends, and what it sends after is left in
    the socket (decrypting it would cost the event loop for nothing): at most the socket
    buffers' worth is taken before the connection is reset, LINGER_S after the answer."""
    # Room for a 32 MiB body, so that the one that is not JSON is refused only for that.
    limits = ServerLimits(max_body_bytes=32 * 2**20, max_inflight_body_bytes=64 * 2**20)
    async with running(tmp_path, limits) as server:
        reader, writer = await refuse(server)
        got, _ = await response(reader)
        sent, chunk = 0, b" " * (256 * 1024)
        loop = asyncio.get_running_loop()
        until = loop.time() + LINGER_S + 1.0
        with contextlib.suppress(ConnectionError, TimeoutError, ssl.SSLError):
            while loop.time() < until and sent < 32 * 2**20:
                writer.write(chunk)
                async with asyncio.timeout_at(until):
                    await writer.drain()
                sent += len(chunk)
        closed = await closed_within(reader, 1.0)
        writer.transport.abort()
        reset = sample(server, "fracgpu_admission_connections_closed_total", reason="unread-body")
    assert got == status
    # Loopback socket buffers take a few MiB; reading the rest would take all 32 in well
    # under a second.
    assert sent < 16 * 2**20
    assert (closed, reset) == (True, 1)


async def test_pieces_take_at_most_their_share_and_let_others_run() -> None:
    share = LoopShare(0.25, burst=0.005)
    ticks = 0

    async def other() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    def work(_: bytes) -> None:
        # Busy for 2 ms, as a piece of parsing holds the loop (sleeping would yield it).
        until = time.perf_counter() + 0.002
        while time.perf_counter() < until:
            pass

    ticker = asyncio.ensure_future(other())
    await asyncio.sleep(0)
    started = time.perf_counter()
    for _ in range(40):  # 80 ms of work
        await share.run(work, b"")
    wall = time.perf_counter() - started
    ticker.cancel()
    # 80 ms at a quarter of the loop, less the 5 ms burst and the last piece's overdraft.
    assert wall >= (0.080 - 0.005 - 0.002) / 0.25
    assert ticks >= 40  # the other task ran between every two pieces


@pytest.mark.parametrize(
    ("size", "spent", "expected"),
    [
        pytest.param(16384, 0.0005, 16384, id="on target: kept"),
        pytest.param(16384, 0.003, 8192, id="dense: halved"),
        pytest.param(16384, 0.0001, 32768, id="light: doubled"),
        pytest.param(MIN_PIECE_BYTES, 0.01, MIN_PIECE_BYTES, id="never below the least"),
        pytest.param(MAX_PIECE_BYTES, 0.0, MAX_PIECE_BYTES, id="never above the most"),
    ],
)
def test_pieces_are_sized_to_take_about_the_target(size: int, spent: float, expected: int) -> None:
    assert _next_piece(size, spent) == expected


async def test_large_bodies_on_many_connections_at_once_are_each_read_whole(
    tmp_path: Path,
) -> None:
    """Every connection is read into one shared buffer: what each hands on must be its own."""
    limits = ServerLimits(large_body_bytes_per_second=64 * 2**20)

    def large(uid: str) -> bytes:
        body = copy.deepcopy(EXAMPLE)
        body["request"]["uid"] = uid
        container = body["request"]["object"]["spec"]["containers"][0]
        container["env"] = [{"name": f"V_{uid}_{i}", "value": uid * 100} for i in range(400)]
        return json.dumps(body).encode().ljust(2 * LARGE_BODY_BYTES)

    async with running(tmp_path, limits) as server:
        uids = [f"u{i}" for i in range(4)]
        replies = await asyncio.gather(
            *(server.post("/mutate", None, raw=large(uid)) for uid in uids)
        )
        answered = [(await r.json())["response"]["uid"] for r in replies]
    assert answered == uids


async def test_a_closed_connection_needs_no_cyclic_collection(tmp_path: Path) -> None:
    """Freed when it closes, not left for a full collection with hundreds of others."""
    async with running(tmp_path) as server:
        gc.collect()
        gc.disable()
        try:
            for _ in range(5):
                reader, writer = await tls(server)
                raw = json.dumps(EXAMPLE).encode()
                writer.write(head(len(raw)) + raw)
                await response(reader)
                writer.transport.abort()
            await eventually(lambda: sample(server, "fracgpu_admission_connections") == 0)
            left = [o for o in gc.get_objects() if isinstance(o, _Connection)]
        finally:
            gc.enable()
    assert left == []
