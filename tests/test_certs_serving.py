"""The serving context: real TLS handshakes against aiohttp, hot reload, TLS policy."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
from aiohttp import web
from cryptography import x509
from prometheus_client import CollectorRegistry

from certs.config import CertsConfig
from certs.issuance import issue_ca
from certs.material import fingerprint
from certs.rotation import Request
from certs.serving import ServingCertificates, open_serving
from certs.sources import ManagedSource, utcnow
from certs.tlspolicy import client_context


async def _hello(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[ServingCertificates, int]]:
    certs = await open_serving(CertsConfig(directory=tmp_path / "certs"), standalone=True)
    app = web.Application()
    app.router.add_get("/", _hello)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=certs.context)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield certs, port
    await runner.cleanup()


async def _get(port: int, bundle: bytes, host: str = "127.0.0.1") -> x509.Certificate:
    """One HTTPS request on a fresh connection whose handshake verifies against ``bundle``;
    returns the certificate the server presented."""
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=client_context(bundle), server_hostname=host
    )
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.write(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        response = await reader.read()
    finally:
        writer.close()
    assert response.startswith(b"HTTP/1.1 200"), response[:200]
    assert response.endswith(b'{"ok": true}')
    return x509.load_der_x509_certificate(der)


async def test_handshake_verifies_against_ca_bundle(
    served: tuple[ServingCertificates, int],
) -> None:
    certs, port = served
    for host in ("127.0.0.1", "localhost"):
        cert = await _get(port, certs.ca_bundle_pem(), host)
        assert cert == certs.state.leaf
    assert certs.ready()


async def test_untrusted_bundle_is_refused(served: tuple[ServingCertificates, int]) -> None:
    _, port = served
    stranger = issue_ca(
        common_name="stranger",
        lifetime=timedelta(days=1),
        now=utcnow(),
        backdate=timedelta(hours=1),
        algorithm="ecdsa-p256",
    )
    with pytest.raises(ssl.SSLCertVerificationError):
        await _get(port, stranger.cert_pem())


async def test_rotation_is_served_without_restart(
    served: tuple[ServingCertificates, int],
) -> None:
    certs, port = served
    assert isinstance(certs.source, ManagedSource)
    before = await _get(port, certs.ca_bundle_pem())
    await certs.source.ensure(Request(serving=True))
    assert await certs.refresh()
    # Python's client sends no SNI for an IP address; OpenSSL still runs the server's SNI
    # callback, so both kinds of client get the new certificate.
    for host in ("127.0.0.1", "localhost"):
        after = await _get(port, certs.ca_bundle_pem(), host)
        assert after != before
        assert after == certs.state.leaf
    # The CA did not change, so the old bundle still verifies the new certificate.
    assert certs.state.trusted[0].subject == after.issuer


async def test_metrics_expose_expiry_and_reloads(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    certs = await open_serving(
        CertsConfig(directory=tmp_path / "certs"), standalone=True, registry=registry
    )
    leaf = certs.state.leaf
    labels = {"certificate": "serving", "fingerprint": fingerprint(leaf)}
    expiry = registry.get_sample_value("fracgpu_certs_not_after_timestamp_seconds", labels)
    assert expiry == leaf.not_valid_after_utc.timestamp()
    assert registry.get_sample_value("fracgpu_certs_reloads_total") == 0
    assert isinstance(certs.source, ManagedSource)
    await certs.source.ensure(Request(serving=True))
    await certs.refresh()
    assert registry.get_sample_value("fracgpu_certs_reloads_total") == 1
    # The old certificate's series is gone: an alert sees only what is served.
    assert registry.get_sample_value("fracgpu_certs_not_after_timestamp_seconds", labels) is None


def _raw_handshake(port: int, context: ssl.SSLContext) -> None:
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as sock,
        context.wrap_socket(sock, server_hostname=None),
    ):
        pass


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    "version", [ssl.TLSVersion.TLSv1, ssl.TLSVersion.TLSv1_1], ids=["TLS 1.0", "TLS 1.1"]
)
async def test_old_tls_versions_are_refused(
    served: tuple[ServingCertificates, int], version: ssl.TLSVersion
) -> None:
    _, port = served
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        ctx.set_ciphers("ALL:@SECLEVEL=0")
        ctx.minimum_version = version
        ctx.maximum_version = version
    except (ValueError, ssl.SSLError):
        pytest.skip(f"this OpenSSL cannot even offer {version.name}")
    with pytest.raises((ssl.SSLError, ConnectionResetError)):
        await asyncio.to_thread(_raw_handshake, port, ctx)


@pytest.mark.parametrize("cipher", ["AES128-SHA", "AES256-GCM-SHA384", "ECDHE-ECDSA-AES128-SHA"])
async def test_weak_tls12_ciphers_are_refused(
    served: tuple[ServingCertificates, int], cipher: str
) -> None:
    _, port = served
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_ciphers(cipher)
    with pytest.raises(ssl.SSLError):
        await asyncio.to_thread(_raw_handshake, port, ctx)


async def test_tls12_with_forward_secret_aead_is_accepted(
    served: tuple[ServingCertificates, int],
) -> None:
    certs, port = served
    ctx = client_context(certs.ca_bundle_pem())
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2

    def handshake() -> tuple[str | None, str]:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=5) as sock,
            ctx.wrap_socket(sock, server_hostname="localhost") as tls,
        ):
            return tls.version(), tls.cipher()[0]

    version, name = await asyncio.to_thread(handshake)
    assert version == "TLSv1.2"
    assert name.startswith("ECDHE-")
    assert "GCM" in name or "CHACHA20" in name
