"""The certificate scenarios against a real cluster (FRACGPU_E2E_KUBECONFIG): concurrent create
from several replicas, one CA rotation among racing replicas, injection and re-injection.

Everything lives in a fresh namespace and a webhook configuration of the test's own that matches
a resource nobody has (failurePolicy Ignore), both deleted afterwards.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import secrets
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from certs.config import CertsConfig
from certs.inject import CaBundleInjector
from certs.material import Material
from certs.secretstore import SecretStore
from certs.sources import ManagedSource
from core.kube import (
    NAMESPACES,
    SECRETS,
    VALIDATING_WEBHOOK_CONFIGURATIONS,
    KubeError,
    call_json,
    kube_client,
)

E2E_ENV = "FRACGPU_E2E_KUBECONFIG"
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not os.environ.get(E2E_ENV), reason=f"e2e: needs a real cluster; set {E2E_ENV}"
    ),
]
SECRET = "fracgpu-webhook-tls"


@pytest.fixture
async def certs_api() -> AsyncIterator[Any]:
    async with kube_client(_kubeconfig()) as api:
        yield api


async def _delete(api: Any, path: str) -> None:
    try:
        await call_json(api, "DELETE", path)
    except KubeError as err:
        if err.status != 404:
            raise


@pytest.fixture
async def certs_namespace(certs_api: Any) -> AsyncIterator[str]:
    name = f"fracgpu-e2e-certs-{secrets.token_hex(3)}"
    body = {"metadata": {"name": name, "labels": {"fracgpu.io/e2e": "true"}}}
    await call_json(certs_api, "POST", NAMESPACES.path(), body=body)
    try:
        yield name
    finally:
        await _delete(certs_api, NAMESPACES.path(name=name))


def _config(namespace: str, **fields: Any) -> CertsConfig:
    return CertsConfig(mode="secret", namespace=namespace, secret_name=SECRET, **fields)


async def _stored(api: Any, namespace: str) -> Material:
    obj = await call_json(api, "GET", SECRETS.path(namespace, SECRET))
    return Material.from_files({k: base64.b64decode(v) for k, v in obj["data"].items()})


async def test_replicas_starting_together_share_the_winners_certificate(
    certs_namespace: str,
) -> None:
    config = _config(certs_namespace)
    async with replica_clients(5) as clients:
        sources = [
            ManagedSource(SecretStore(api, certs_namespace, SECRET), config, standalone=False)
            for api in clients
        ]
        results = await asyncio.gather(*(s.ensure() for s in sources))
        stored = await _stored(clients[0], certs_namespace)
    assert all(m == stored for m in results)


async def test_racing_replicas_rotate_the_ca_once(certs_namespace: str) -> None:
    config = _config(certs_namespace)
    async with replica_clients(3) as clients:
        sources = [
            ManagedSource(SecretStore(api, certs_namespace, SECRET), config, standalone=False)
            for api in clients
        ]
        first = await sources[0].ensure()
        due = first.ca.cert.not_valid_after_utc - config.ca_renew_before
        for s in sources:
            s.clock = lambda: due
        results = await asyncio.gather(*(s.ensure() for s in sources))
        stored = await _stored(clients[0], certs_namespace)
    assert all(m == stored for m in results)
    assert stored.trusted == (stored.ca.cert, first.ca.cert)


def _webhook_configuration(name: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name, "labels": {"fracgpu.io/e2e": "true"}},
        "webhooks": [
            {
                "name": "e2e.certs.fracgpu.io",
                "clientConfig": {
                    "service": {"namespace": namespace, "name": "nobody", "path": "/x"}
                },
                "rules": [
                    {
                        "apiGroups": ["e2e.fracgpu.io"],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE"],
                        "resources": ["nothings"],
                    }
                ],
                "failurePolicy": "Ignore",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
            }
        ],
    }


async def test_cabundle_is_injected_and_reinjected(certs_api: Any, certs_namespace: str) -> None:
    name = f"fracgpu-e2e-certs-{secrets.token_hex(3)}"
    config = _config(
        certs_namespace,
        mutating_webhook_configurations=[],
        validating_webhook_configurations=[name],
    )
    path = VALIDATING_WEBHOOK_CONFIGURATIONS.path(name=name)
    collection = VALIDATING_WEBHOOK_CONFIGURATIONS.path()
    body = _webhook_configuration(name, certs_namespace)
    material = await ManagedSource(
        SecretStore(certs_api, certs_namespace, SECRET), config, standalone=False
    ).ensure()
    bundle = material.bundle_pem()

    async def current() -> bool:
        obj = await call_json(certs_api, "GET", path)
        return all(
            base64.b64decode(w["clientConfig"].get("caBundle", "")) == bundle
            for w in obj["webhooks"]
        )

    await call_json(certs_api, "POST", collection, body=body)
    changed = asyncio.Event()
    task = asyncio.create_task(CaBundleInjector(certs_api, config).run(lambda: bundle, changed))
    try:
        await _eventually(current)
        # Re-applied without caBundle, then deleted and re-created: injected again each time.
        obj = await call_json(certs_api, "GET", path)
        body["metadata"]["resourceVersion"] = obj["metadata"]["resourceVersion"]
        await call_json(certs_api, "PUT", path, body=body)
        await _eventually(current)
        await call_json(certs_api, "DELETE", path)
        body["metadata"].pop("resourceVersion")
        await call_json(certs_api, "POST", collection, body=body)
        await _eventually(current)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await _delete(certs_api, path)


async def _eventually(check: Callable[[], Any], within_s: float = 30.0) -> None:
    async with asyncio.timeout(within_s):
        while True:
            if await check():
                return
            await asyncio.sleep(0.2)


def _kubeconfig() -> Path:
    return Path(os.environ[E2E_ENV]).expanduser()


@contextlib.asynccontextmanager
async def replica_clients(count: int) -> AsyncIterator[list[Any]]:
    """Several independent clients, as several replicas would have."""
    async with contextlib.AsyncExitStack() as stack:
        path = _kubeconfig()
        yield [await stack.enter_async_context(kube_client(path)) for _ in range(count)]
