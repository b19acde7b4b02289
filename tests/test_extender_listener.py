"""The extender's own listener in ``fracgpu serve``: it requires a client certificate signed by
fracgpu's CA (the scheduler's, which serve issues into its Secret), because bind binds pods with
serve's permissions; the admission listener, which the API server calls without a client
certificate, no longer serves the extender's paths."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from certs.issuance import issue_ca, issue_client
from certs.sources import utcnow
from extender.service import BIND_PATH, FILTER_PATH, ExtenderConfig
from fracgpu.serve import run_server
from testkit.apiserver import FakeApiServer
from testkit.extender import Gpu, node
from testkit.kinds import GPUNODELEDGER
from tests.serving import SECRET, in_cluster_config
from tests.support import eventually, free_port
from webhook.server import METRICS_PATH

CLIENT_SECRET = ("secrets", "fracgpu-scheduler-client-tls", "fracgpu")
FILTER_ARGS = {"Pod": {"metadata": {"name": "p", "namespace": "team"}}, "NodeNames": ["n1"]}


@dataclass
class Served:
    """A running serve: the fake API server, the two ports, and where to write key files."""

    fake: FakeApiServer
    admission: int
    extender: int
    tmp: Path

    def secret_file(self, secret: tuple[str, str, str], key: str) -> Path:
        obj = self.fake.get(*secret)
        assert obj is not None
        path = self.tmp / f"{secret[1]}-{key}"
        path.write_bytes(base64.b64decode(obj["data"][key]))
        return path

    def trusting_serve(self) -> ssl.SSLContext:
        """A client context that trusts serve's CA (as the scheduler's caFile), no certificate."""
        return ssl.create_default_context(cafile=str(self.secret_file(CLIENT_SECRET, "ca.crt")))


@contextlib.asynccontextmanager
async def serving(tmp_path: Path) -> AsyncIterator[Served]:
    async with FakeApiServer(namespaces=("default", "fracgpu", "team")) as fake:
        fake.register(GPUNODELEDGER)
        fake.put(node("n1", Gpu("GPU-1")))
        admission, extender = free_port(), free_port()
        config = in_cluster_config(fake, tmp_path, admission).model_copy(
            update={"extender": ExtenderConfig(enabled=True, port=extender)}
        )
        stop = asyncio.Event()
        server = asyncio.ensure_future(run_server(config, standalone=False, stop=stop))
        await eventually(lambda: fake.get(*CLIENT_SECRET) is not None, within_s=10)
        yield Served(fake, admission, extender, tmp_path)
        stop.set()
        assert await asyncio.wait_for(server, 10) == 0


async def post(context: ssl.SSLContext, url: str, body: Any) -> tuple[int, Any]:
    """POST, waiting for the port to listen (connection refused) but not past a TLS refusal."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as http:
        for _ in range(300):
            try:
                async with http.post(url, json=body) as resp:
                    text = await resp.text()
                    return resp.status, json.loads(text) if resp.status == 200 else text
            except aiohttp.ClientConnectorError as err:
                if not isinstance(err.os_error, ConnectionRefusedError):
                    raise
            await asyncio.sleep(0.02)
    raise AssertionError(f"{url} never listened")


# --- who may call the extender ------------------------------------------------------------------

Client = Callable[[Served], ssl.SSLContext]


def _scheduler(served: Served) -> ssl.SSLContext:
    context = served.trusting_serve()
    context.load_cert_chain(
        served.secret_file(CLIENT_SECRET, "tls.crt"), served.secret_file(CLIENT_SECRET, "tls.key")
    )
    return context


def _no_certificate(served: Served) -> ssl.SSLContext:
    return served.trusting_serve()


def _another_ca(served: Served) -> ssl.SSLContext:
    """A well-formed client certificate, named as the scheduler's, from a CA serve never issued."""
    now = utcnow()
    ca = issue_ca(
        common_name="fracgpu webhook CA",
        lifetime=timedelta(days=30),
        now=now,
        backdate=timedelta(hours=1),
        algorithm="ecdsa-p256",
    )
    client = issue_client(
        ca,
        common_name="fracgpu-scheduler",
        lifetime=timedelta(days=1),
        now=now,
        backdate=timedelta(hours=1),
        algorithm="ecdsa-p256",
    )
    cert, key = served.tmp / "other.crt", served.tmp / "other.key"
    cert.write_bytes(client.cert_pem())
    key.write_bytes(client.key_pem())
    context = served.trusting_serve()
    context.load_cert_chain(cert, key)
    return context


def _serving_certificate(served: Served) -> ssl.SSLContext:
    """serve's own serving certificate (fracgpu's CA, serverAuth only): not a client's."""
    context = served.trusting_serve()
    context.load_cert_chain(
        served.secret_file(SECRET, "tls.crt"), served.secret_file(SECRET, "tls.key")
    )
    return context


@pytest.mark.parametrize(
    "client",
    [
        pytest.param(_no_certificate, id="no-client-certificate"),
        pytest.param(_another_ca, id="client-certificate-from-another-ca"),
        pytest.param(_serving_certificate, id="fracgpus-serving-certificate-is-no-client-cert"),
    ],
)
async def test_the_extender_refuses_a_client_without_fracgpus_client_certificate(
    tmp_path: Path, client: Client
) -> None:
    async with serving(tmp_path) as served:
        url = f"https://127.0.0.1:{served.extender}{BIND_PATH}"
        bind = {"PodName": "p", "PodNamespace": "team", "PodUID": "u", "Node": "n1"}
        # It listens (the scheduler is let in), so a refusal below is the certificate's doing.
        assert (await post(_scheduler(served), url, {}))[0] == 400
        with pytest.raises((aiohttp.ClientError, ssl.SSLError)):
            await post(client(served), url, bind)


async def test_the_scheduler_certificate_is_accepted_and_admission_serves_no_extender(
    tmp_path: Path,
) -> None:
    async with serving(tmp_path) as served:
        status, reply = await post(
            _scheduler(served), f"https://127.0.0.1:{served.extender}{FILTER_PATH}", FILTER_ARGS
        )
        assert status == 200 and "NodeNames" in reply
        # The admission port: no client certificate needed there, and no extender either.
        status, _ = await post(
            served.trusting_serve(), f"https://127.0.0.1:{served.admission}{BIND_PATH}", {}
        )
        assert status == 404
        # The call is counted and timed in serve's /metrics (on the admission port).
        connector = aiohttp.TCPConnector(ssl=served.trusting_serve())
        async with (
            aiohttp.ClientSession(connector=connector) as http,
            http.get(f"https://127.0.0.1:{served.admission}{METRICS_PATH}") as resp,
        ):
            exposed = await resp.text()
        assert 'fracgpu_extender_answers_total{outcome="ok",verb="filter"} 1.0' in exposed
        assert 'fracgpu_extender_duration_seconds_count{verb="filter"} 1.0' in exposed


async def test_the_client_secret_holds_a_client_certificate_from_serves_ca(tmp_path: Path) -> None:
    """What the scheduler mounts: tls.crt (clientAuth) and tls.key, and ca.crt = serve's
    bundle, so that it verifies the extender's serving certificate."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    from certs.issuance import signed_by

    async with serving(tmp_path) as served:
        secret = served.fake.get(*CLIENT_SECRET)
        assert secret is not None and secret["type"] == "kubernetes.io/tls"
        data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
        bundle = served.fake.get(*SECRET)
        assert bundle is not None
        assert data["ca.crt"] == base64.b64decode(bundle["data"]["ca-bundle.crt"])
        cert = x509.load_pem_x509_certificate(data["tls.crt"])
        ca = x509.load_pem_x509_certificate(base64.b64decode(bundle["data"]["ca.crt"]))
        assert signed_by(cert, ca)
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert list(usages) == [ExtendedKeyUsageOID.CLIENT_AUTH]


async def test_in_files_mode_the_extender_trusts_the_mounted_ca_and_serve_issues_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """cert-manager (certs mode files): serve has no CA key, so it neither issues nor writes the
    scheduler's client certificate, and says where it comes from; the extender's port accepts
    one from the CA in the mounted ca.crt (cert-manager's Certificate fracgpu-scheduler-client)
    and refuses one from another CA."""
    from certs.config import CertsConfig
    from certs.issuance import Issued
    from tests.test_certs_files import files_config, issue, publish

    mount = tmp_path / "tls"
    mount.mkdir()
    material = issue(["127.0.0.1"])
    publish(mount, material, 1)
    async with FakeApiServer(namespaces=("default", "fracgpu", "team")) as fake:
        fake.register(GPUNODELEDGER)
        fake.put(node("n1", Gpu("GPU-1")))
        admission, extender = free_port(), free_port()
        config = in_cluster_config(fake, tmp_path, admission).model_copy(
            update={
                "certs": CertsConfig.model_validate(
                    {**files_config(mount).model_dump(), "namespace": "fracgpu"}
                ),
                "extender": ExtenderConfig(enabled=True, port=extender),
            }
        )
        stop = asyncio.Event()
        caplog.set_level("INFO", logger="fracgpu.serve")
        server = asyncio.ensure_future(run_server(config, standalone=False, stop=stop))
        try:

            def client_of(ca: Issued | None, name: str) -> ssl.SSLContext:
                """The scheduler's side: trusts the mounted CA, presents a certificate from
                ``ca`` (none if None)."""
                context = ssl.create_default_context(cadata=material.bundle_pem().decode())
                context.check_hostname = False  # the serving certificate's name is not tested
                if ca is None:
                    return context
                client = issue_client(
                    ca, common_name="fracgpu-scheduler", lifetime=timedelta(days=1),
                    now=utcnow(), backdate=timedelta(hours=1), algorithm="ecdsa-p256",
                )  # fmt: skip
                cert, key = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
                cert.write_bytes(client.cert_pem())
                key.write_bytes(client.key_pem())
                context.load_cert_chain(cert, key)
                return context

            url = f"https://127.0.0.1:{extender}{FILTER_PATH}"
            status, reply = await post(client_of(material.ca, "scheduler"), url, FILTER_ARGS)
            assert status == 200 and "NodeNames" in reply
            with pytest.raises((aiohttp.ClientError, ssl.SSLError)):
                await post(client_of(issue(["x"]).ca, "other"), url, FILTER_ARGS)
            with pytest.raises((aiohttp.ClientError, ssl.SSLError)):
                await post(client_of(None, "none"), url, FILTER_ARGS)
        finally:
            stop.set()
            assert await asyncio.wait_for(server, 10) == 0
        assert fake.get(*CLIENT_SECRET) is None
        assert not [r for r in fake.requests if "/secrets" in r.path]
        (said,) = [r for r in caplog.records if "client certificate is not issued" in r.message]
        assert said.levelname == "INFO"
        assert said.secret == "fracgpu/fracgpu-scheduler-client-tls"  # type: ignore[attr-defined]
