"""Several webhook replicas in secret mode against the fake API server: one certificate for all,
caBundle injected and following a CA rotation, nothing secret in the logs."""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import config as kube_config

from certs.config import CertsConfig
from certs.rotation import Request
from certs.serving import ServingCertificates, open_serving
from certs.sources import ManagedSource
from testkit.apiserver import DEFAULT_NAMESPACES, FakeApiServer
from tests.support import eventually
from tests.test_certs_inject import webhook_configuration

NS = "fracgpu"
CONFIG = CertsConfig(
    mode="secret",
    check_interval=timedelta(milliseconds=100),
    ca_propagation=timedelta(seconds=1),
)


@pytest.fixture
async def fake() -> AsyncIterator[FakeApiServer]:
    async with FakeApiServer(namespaces=(*DEFAULT_NAMESPACES, NS), bookmark_interval=0.2) as f:
        yield f


MUTATING = CONFIG.mutating_webhook_configurations[0]
VALIDATING = CONFIG.validating_webhook_configurations[0]
NAMES = {"mutatingwebhookconfigurations": MUTATING, "validatingwebhookconfigurations": VALIDATING}


def injected(fake: FakeApiServer, plural: str) -> set[bytes]:
    obj = fake.get(plural, NAMES[plural])
    assert obj is not None
    return {base64.b64decode(w["clientConfig"].get("caBundle", "")) for w in obj["webhooks"]}


async def test_replicas_share_one_certificate_and_keep_cabundle_current(
    fake: FakeApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    fake.put(webhook_configuration("MutatingWebhookConfiguration", MUTATING))
    fake.put(webhook_configuration("ValidatingWebhookConfiguration", VALIDATING))
    kubeconfig = fake.kubeconfig(tmp_path / "kubeconfig")
    clients: list[Any] = []
    replicas: list[ServingCertificates] = []
    tasks: list[asyncio.Task[None]] = []
    try:
        for _ in range(3):
            clients.append(
                await kube_config.new_client_from_config(
                    config_file=str(kubeconfig), persist_config=False
                )
            )
        replicas = list(
            await asyncio.gather(
                *(open_serving(CONFIG, standalone=False, api=api) for api in clients)
            )
        )
        assert len({r.state.digest() for r in replicas}) == 1
        tasks = [asyncio.create_task(r.run()) for r in replicas]
        bundle = replicas[0].ca_bundle_pem()
        for plural in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations"):
            await eventually(lambda p=plural: injected(fake, p) == {bundle}, within_s=10)

        # One replica starts a CA rotation (as `fracgpu certs rotate --ca` would).
        source = replicas[0].source
        assert isinstance(source, ManagedSource)
        rotated = await source.ensure(Request(ca=True))
        assert len(rotated.trusted) == 2
        # Every replica loads it, the overlap bundle is injected, and after ca_propagation the
        # serving certificate moves to the new CA everywhere.
        await eventually(
            lambda: injected(fake, "mutatingwebhookconfigurations") == {rotated.bundle_pem()},
            within_s=10,
        )
        await eventually(
            lambda: (
                all(r.state.leaf.issuer == rotated.ca.cert.subject for r in replicas)
                and len({r.state.digest() for r in replicas}) == 1
            ),
            within_s=10,
        )
        assert replicas[1].state.trusted == rotated.trusted
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for r in replicas:
            await r.close()
        for api in clients:
            await api.close()
    logged = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert "certificates renewed" in logged
    assert "caBundle injected" in logged
    assert "PRIVATE KEY" not in logged
