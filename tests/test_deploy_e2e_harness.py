"""Offline checks of the e2e harness (tests/e2e): what it registers in a cluster is the deployed
webhook configuration, valid, pointed at the local webhook and confined to the run's namespaces;
its certificates verify for the address the API server dials."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import ssl
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from fracgpu.serve import ServeConfig
from tests.deploy_render import ROOT, kubectl
from tests.e2e.harness import (
    RUN_LABEL,
    LocalWebhook,
    for_local_webhook,
    issue_certificates,
    rendered_webhook_configurations,
)
from tests.fakes.apiserver import FakeApiServer
from webhook import server

EXAMPLE = ROOT / "examples" / "admissionreview-pod.json"


def test_local_webhook_config_is_one_serve_accepts(tmp_path: Path) -> None:
    local = LocalWebhook(tmp_path, "127.0.0.1", "127.0.0.1", "/nonexistent/kubeconfig")
    config = ServeConfig.model_validate(yaml.safe_load(local.config_path.read_text()))
    assert config.certs.mode == "files" and not config.certs.injects
    assert (config.server.host, config.server.port) == ("127.0.0.1", local.port)


@pytest.mark.parametrize("host", ["127.0.0.1", "host.k3d.internal"])
def test_registration_is_the_deployed_configuration_aimed_at_the_local_webhook(
    tmp_path: Path, host: str
) -> None:
    kubectl()
    deployed = rendered_webhook_configurations()
    local = LocalWebhook(tmp_path, host, "127.0.0.1", "/nonexistent/kubeconfig")
    objs = for_local_webhook(deployed, "abc123", local)
    assert [o["kind"] for o in objs] == [o["kind"] for o in deployed]
    paths = {"MutatingWebhookConfiguration": server.MUTATE_PATH}
    paths["ValidatingWebhookConfiguration"] = server.VALIDATE_PATH
    for obj, original in zip(objs, deployed, strict=True):
        kubernetes_validate.validate(obj, "1.30.0", strict=True)
        assert obj["metadata"]["name"].endswith("-e2e-abc123")
        (hook,) = obj["webhooks"]
        (orig,) = original["webhooks"]
        assert hook["clientConfig"]["url"] == f"https://{host}:{local.port}{paths[obj['kind']]}"
        assert base64.b64decode(hook["clientConfig"]["caBundle"]) == local.ca_pem
        assert hook["namespaceSelector"] == {"matchLabels": {RUN_LABEL: "abc123"}}
        unchanged = ("name", "rules", "matchConditions", "failurePolicy", "timeoutSeconds")
        for key in unchanged:
            assert hook[key] == orig[key], key
        assert "service" in orig["clientConfig"], "the deployed one still uses the Service"


def _handshake(cert: Path, key: Path, ca: Path, server_hostname: str) -> None:
    """A TLS handshake in memory; raises ssl.SSLCertVerificationError if the client rejects."""
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cadata=ca.read_text())
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname=server_hostname)
    srv = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):
        for side in (client, srv):
            with contextlib.suppress(ssl.SSLWantReadError):
                side.do_handshake()
        s_in.write(c_out.read())
        c_in.write(s_out.read())
    client.do_handshake()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_certificates_verify_for_the_dialled_host(tmp_path: Path, host: str) -> None:
    cert, key, ca = issue_certificates(tmp_path, host)
    assert key.stat().st_mode & 0o077 == 0
    _handshake(cert, key, ca, host)
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(cert, key, ca, "example.org")


async def test_local_webhook_runs_the_real_cli_and_stops(tmp_path: Path) -> None:
    """The harness's `fracgpu serve` process, against the fake API server: ready, answering
    /mutate over TLS with the harness's CA, and stopped cleanly (and restartable)."""
    async with FakeApiServer() as fake:
        kubeconfig = str(fake.kubeconfig(tmp_path / "kubeconfig"))
        local = LocalWebhook(tmp_path, "127.0.0.1", "127.0.0.1", kubeconfig)
        try:
            await asyncio.to_thread(local.start)
            review = json.loads(EXAMPLE.read_text())
            reply = await asyncio.to_thread(_post, local, server.MUTATE_PATH, review)
            assert reply["response"]["uid"] == review["request"]["uid"]
            assert reply["response"]["allowed"] is True
            await asyncio.to_thread(local.stop)
            assert local.process is None
            await asyncio.to_thread(local.start)
        finally:
            await asyncio.to_thread(local.stop)


def _post(local: LocalWebhook, path: str, body: dict[str, object]) -> dict[str, Any]:
    context = ssl.create_default_context(cadata=local.ca_pem.decode())
    request = urllib.request.Request(
        local.url(path),
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, context=context, timeout=10) as response:
        data: dict[str, Any] = json.loads(response.read())
        return data
