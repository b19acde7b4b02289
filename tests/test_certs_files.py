"""files mode (cert-manager) and the directory store."""

from __future__ import annotations

import asyncio
import os
import ssl
import stat
from datetime import timedelta
from pathlib import Path

import pytest

from certs.config import CertsConfig
from certs.issuance import Issued, issue_client
from certs.material import CA_KEY, TLS_CERT, TLS_KEY, Material
from certs.rotation import Request, plan
from certs.serving import ServingError, open_serving
from certs.sources import ManagedSource, utcnow
from certs.stores import DirectoryStore, StoreConflict


def issue(hosts: list[str]) -> Material:
    config = CertsConfig(hosts=hosts)
    return plan(None, config, standalone=True, now=utcnow()).material


def publish(mount: Path, material: Material, generation: int) -> None:
    """Writes files the way kubelet updates a Secret volume: a new timestamped directory, then
    an atomic swap of the ``..data`` symlink the visible names point through."""
    target = mount / f"..{generation}"
    target.mkdir()
    (target / "tls.crt").write_bytes(material.serving.cert_pem())
    (target / "tls.key").write_bytes(material.serving.key_pem())
    (target / "ca.crt").write_bytes(material.bundle_pem())
    tmp = mount / "..data_tmp"
    tmp.symlink_to(target.name)
    os.replace(tmp, mount / "..data")
    for name in ("tls.crt", "tls.key", "ca.crt"):
        link = mount / name
        if not link.is_symlink():
            link.symlink_to(f"..data/{name}")


def files_config(mount: Path) -> CertsConfig:
    return CertsConfig(
        mode="files",
        cert_file=mount / "tls.crt",
        key_file=mount / "tls.key",
        ca_file=mount / "ca.crt",
        file_poll_interval=timedelta(milliseconds=50),
    )


async def test_files_mode_reloads_when_the_mounted_secret_changes(tmp_path: Path) -> None:
    first, second = issue(["a"]), issue(["b"])
    publish(tmp_path, first, 1)
    certs = await open_serving(files_config(tmp_path), standalone=False)
    assert certs.state.leaf == first.serving.cert
    assert certs.ca_bundle_pem() == first.bundle_pem()
    assert certs.consumers == ()  # cert-manager's cainjector owns caBundle in files mode
    runner = asyncio.create_task(certs.run())
    try:
        publish(tmp_path, second, 2)
        async with asyncio.timeout(5):
            while True:
                if certs.state.leaf == second.serving.cert:
                    break
                await asyncio.sleep(0.02)
        assert certs.ca_bundle_pem() == second.bundle_pem()
    finally:
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner


async def test_files_mode_keeps_serving_through_a_torn_update(tmp_path: Path) -> None:
    first, second = issue(["a"]), issue(["b"])
    publish(tmp_path, first, 1)
    certs = await open_serving(files_config(tmp_path), standalone=False)
    # Certificate replaced but not yet its key (a writer that is not atomic).
    (tmp_path / "..1" / "tls.crt").write_bytes(second.serving.cert_pem())
    assert not await certs.refresh()
    assert certs.state.leaf == first.serving.cert
    (tmp_path / "..1" / "tls.key").write_bytes(second.serving.key_pem())
    assert await certs.refresh()
    assert certs.state.leaf == second.serving.cert


async def test_files_mode_refuses_to_start_without_files(tmp_path: Path) -> None:
    with pytest.raises(ServingError, match=r"certs\.cert_file"):
        await open_serving(files_config(tmp_path), standalone=False)


async def test_directory_store_files_and_modes(tmp_path: Path) -> None:
    directory = tmp_path / "certs"
    certs = await open_serving(CertsConfig(directory=directory), standalone=True)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for name in (CA_KEY, TLS_KEY):
        assert stat.S_IMODE((directory / name).stat().st_mode) == 0o600
    assert stat.S_IMODE((directory / TLS_CERT).stat().st_mode) == 0o644
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [".lock", "ca.crt", "ca.key", "ca-bundle.crt", "tls.crt", "tls.key"]
    )
    # A second start uses what is there.
    again = await open_serving(CertsConfig(directory=directory), standalone=True)
    assert again.state == certs.state


async def test_directory_store_compare_and_swap(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path / "certs")
    files, version = await store.load()
    assert (files, version) == (None, None)
    a = issue(["a"]).to_files()
    v1 = await store.save(a, None)
    with pytest.raises(StoreConflict):
        await store.save(issue(["b"]).to_files(), None)
    assert await store.load() == (a, v1)
    b = issue(["b"]).to_files()
    await store.save(b, v1)
    with pytest.raises(StoreConflict):
        await store.save(a, v1)


async def test_directory_server_picks_up_a_rotation_by_another_process(tmp_path: Path) -> None:
    config = CertsConfig(directory=tmp_path / "certs")
    certs = await open_serving(config, standalone=True)
    # `fracgpu certs rotate` in another process: its own source on the same directory.
    other = ManagedSource(DirectoryStore(config.directory), config, standalone=True)
    rotated = await other.ensure(Request(serving=True))
    assert await certs.refresh()
    assert certs.state.leaf == rotated.serving.cert


SERVICE = "fracgpu-webhook.fracgpu.svc"


def scheduler_context(ca: Issued | None, trusted: bytes, tmp: Path) -> ssl.SSLContext:
    """The fracgpu-scheduler's side of the extender's port: it trusts ``trusted`` (its Secret's
    ca.crt) and presents a client certificate from ``ca`` (none if None), as cert-manager
    issues it."""
    context = ssl.create_default_context(cadata=trusted.decode("ascii"))
    if ca is not None:
        client = issue_client(
            ca,
            common_name="fracgpu-scheduler",
            lifetime=timedelta(days=90),
            now=utcnow(),
            backdate=timedelta(hours=1),
            algorithm="ecdsa-p256",
        )
        cert, key = tmp / "client.crt", tmp / "client.key"
        cert.write_bytes(client.cert_pem())
        key.write_bytes(client.key_pem())
        context.load_cert_chain(cert, key)
    return context


async def answer(port: int, context: ssl.SSLContext) -> bytes | None:
    """What the server says on one connection; None if TLS refused it (with TLS 1.3 the
    client's handshake ends first, so a refused certificate shows on the first read)."""
    try:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=context, server_hostname=SERVICE
        )
    except (ssl.SSLError, ConnectionError):
        return None
    try:
        return await reader.read()
    except (ssl.SSLError, ConnectionError):
        return None
    finally:
        writer.close()


async def test_files_mode_extender_port_trusts_client_certificates_from_the_mounted_ca(
    tmp_path: Path,
) -> None:
    """cert-manager with extender placement: serve issues no client certificate in files mode;
    the scheduler's comes from the CA that signs the mounted serving certificate (ca.crt). The
    extender's context accepts a client certificate from that CA, refuses one from another CA
    and a client without one, and follows the mounted ca.crt when cert-manager moves to a new
    CA."""
    mount = tmp_path / "tls"
    mount.mkdir()
    first, other = issue([SERVICE]), issue([SERVICE])
    publish(mount, first, 1)
    certs = await open_serving(files_config(mount), standalone=False)

    async def hello(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"ok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(hello, "127.0.0.1", 0, ssl=certs.mutual_context)
    port = server.sockets[0].getsockname()[1]
    trusted = first.bundle_pem()
    try:
        assert await answer(port, scheduler_context(first.ca, trusted, tmp_path)) == b"ok"
        assert await answer(port, scheduler_context(other.ca, trusted, tmp_path)) in (None, b"")
        assert await answer(port, scheduler_context(None, trusted, tmp_path)) in (None, b"")
        # cert-manager renews the CA: the mounted files change, and with them whom it trusts.
        publish(mount, other, 2)
        assert await certs.refresh()
        trusted = other.bundle_pem()
        assert await answer(port, scheduler_context(other.ca, trusted, tmp_path)) == b"ok"
        assert await answer(port, scheduler_context(first.ca, trusted, tmp_path)) in (None, b"")
    finally:
        server.close()
        await server.wait_closed()
