"""``fracgpu serve`` against the fake API server: its configuration, and a client context
that trusts the CA it issues into its Secret (shared by the serve and quota tests)."""

from __future__ import annotations

import base64
import ssl
from pathlib import Path

from certs.config import CertsConfig
from fracgpu.serve import ServeConfig
from testkit.apiserver import FakeApiServer
from tests.support import eventually
from webhook.config import AdmissionConfig, ServerConfig

SECRET = ("secrets", "fracgpu-webhook-tls", "fracgpu")


def in_cluster_config(
    fake: FakeApiServer, tmp_path: Path, port: int, admission: AdmissionConfig | None = None
) -> ServeConfig:
    """Certificates issued into a Secret in ``fracgpu``, no caBundle injection, no delay."""
    return ServeConfig(
        server=ServerConfig(host="127.0.0.1", port=port),
        admission=admission or AdmissionConfig(),
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


async def issued_ca(fake: FakeApiServer) -> ssl.SSLContext:
    """A client context trusting the CA the server issued, once its Secret exists."""
    await eventually(lambda: fake.get(*SECRET) is not None)
    secret = fake.get(*SECRET)
    assert secret is not None
    bundle = base64.b64decode(secret["data"]["ca-bundle.crt"]).decode()
    return ssl.create_default_context(cadata=bundle)
