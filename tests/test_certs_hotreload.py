"""Hot reload under load: rotations while clients drive /mutate over TLS, zero failed requests.

Every request opens a new connection (so every request is a handshake) and verifies the server
against the CA bundle as it is at that moment, as the API server does with the caBundle that was
injected last. The rotations cover serving renewals and CA rotations with their overlap.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from aiohttp import web
from cryptography import x509

from certs.config import CertsConfig
from certs.rotation import Request
from certs.serving import ServingCertificates, open_serving
from certs.sources import ManagedSource
from certs.tlspolicy import client_context

SERVICE_NAME = "fracgpu-webhook.fracgpu.svc"  # what the API server dials


async def mutate(request: web.Request) -> web.Response:
    review = await request.json()
    uid = review["request"]["uid"]
    return web.json_response(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": {"uid": uid, "allowed": True},
        }
    )


@dataclass
class Tally:
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    serials: set[int] = field(default_factory=set)
    issuers: set[bytes] = field(default_factory=set)  # authority key identifiers


async def admission_call(port: int, bundle: bytes, n: int, tally: Tally) -> None:
    body = json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {"uid": f"uid-{n}", "object": {"kind": "Pod"}},
        }
    ).encode()
    try:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client_context(bundle), server_hostname=SERVICE_NAME
        )
        try:
            der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
            writer.write(
                b"POST /mutate HTTP/1.1\r\nHost: " + SERVICE_NAME.encode() + b"\r\n"
                b"Content-Type: application/json\r\nConnection: close\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )
            response = await reader.read()
        finally:
            writer.close()
        head, _, payload = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        assert json.loads(payload)["response"] == {"uid": f"uid-{n}", "allowed": True}
    except (AssertionError, OSError, ssl.SSLError, ValueError) as exc:
        tally.failures.append(f"request {n}: {type(exc).__name__}: {exc}")
        return
    cert = x509.load_der_x509_certificate(der)
    tally.ok += 1
    tally.serials.add(cert.serial_number)
    aki = cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    assert aki.key_identifier is not None
    tally.issuers.add(aki.key_identifier)


@pytest.fixture
async def server() -> AsyncIterator[tuple[web.AppRunner, list[int]]]:
    app = web.Application()
    app.router.add_post("/mutate", mutate)
    runner = web.AppRunner(app)
    await runner.setup()
    yield runner, []
    await runner.cleanup()


async def start_site(runner: web.AppRunner, certs: ServingCertificates) -> int:
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=certs.context)
    await site.start()
    return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]


class FakeClock:
    def __init__(self) -> None:
        self.now = datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now


CLUSTER_LIKE = CertsConfig(
    ips=["127.0.0.1"],
    inject=False,
    ca_propagation=timedelta(minutes=10),
)


async def test_repeated_rotations_under_load_fail_no_request(
    tmp_path: Path, server: tuple[web.AppRunner, list[int]]
) -> None:
    clock = FakeClock()
    config = CLUSTER_LIKE.model_copy(update={"directory": tmp_path / "certs"})
    certs = await open_serving(config, standalone=False, clock=clock)
    assert isinstance(certs.source, ManagedSource)
    source = certs.source
    port = await start_site(server[0], certs)
    tally = Tally()
    stop = asyncio.Event()

    async def client(worker: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            # The bundle as the API server would have it now.
            await admission_call(port, certs.ca_bundle_pem(), worker * 100_000 + n, tally)

    async def rotate(request: Request) -> None:
        await source.ensure(request)
        await certs.refresh()
        await asyncio.sleep(0.005)

    async def rotator() -> None:
        for cycle in range(6):
            for _ in range(3):
                await rotate(Request(serving=True))
            if cycle % 2 == 0:
                await rotate(Request(ca=True))
                # Time passes in small steps: the serving certificate follows the new CA only
                # after ca_propagation, i.e. many reloads after the bundle changed.
                for _ in range(12):
                    clock.now += config.ca_propagation / 10
                    await rotate(Request())
        stop.set()

    clients = [asyncio.create_task(client(i)) for i in range(4)]
    await rotator()
    await asyncio.gather(*clients)

    assert tally.failures == []
    assert tally.ok >= 100
    assert len(tally.serials) >= 15  # the clients saw most of the rotations
    assert len(tally.issuers) == 4  # and certificates of every CA generation
    await certs.close()


async def test_the_harness_detects_a_rotation_without_overlap(
    tmp_path: Path, server: tuple[web.AppRunner, list[int]]
) -> None:
    config = CLUSTER_LIKE.model_copy(update={"directory": tmp_path / "certs"})
    certs = await open_serving(config, standalone=False)
    assert isinstance(certs.source, ManagedSource)
    port = await start_site(server[0], certs)
    stale_bundle = certs.ca_bundle_pem()
    await certs.source.ensure(Request(ca=True, immediate=True))
    await certs.refresh()
    tally = Tally()
    await admission_call(port, stale_bundle, 1, tally)
    assert len(tally.failures) == 1
    assert "CERTIFICATE_VERIFY_FAILED" in tally.failures[0]
    await admission_call(port, certs.ca_bundle_pem(), 2, tally)
    assert tally.ok == 1


async def test_run_renews_on_schedule_while_serving(
    tmp_path: Path, server: tuple[web.AppRunner, list[int]]
) -> None:
    """The real clock: serving certificates of 3 s renewed at half their life by run()."""
    config = CLUSTER_LIKE.model_copy(
        update={
            "directory": tmp_path / "certs",
            "ca_lifetime": timedelta(hours=1),
            "ca_renew_before": timedelta(minutes=30),
            "ca_propagation": timedelta(seconds=1),
            "serving_lifetime": timedelta(seconds=3),
            "serving_renew_at": 0.5,
            "backdate": timedelta(0),
        }
    )
    certs = await open_serving(config, standalone=False)
    port = await start_site(server[0], certs)
    runner = asyncio.create_task(certs.run())
    tally = Tally()
    n = 0
    try:
        async with asyncio.timeout(20):
            while len(tally.serials) < 3:
                n += 1
                await admission_call(port, certs.ca_bundle_pem(), n, tally)
                await asyncio.sleep(0.02)
    finally:
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner
    assert tally.failures == []
    assert certs.metrics.reloads._value.get() >= 2
