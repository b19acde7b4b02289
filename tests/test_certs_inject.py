"""caBundle injection and re-injection, against the strict fake API server."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from certs.config import CertsConfig
from certs.inject import CaBundleInjector, with_bundle
from certs.metrics import CertsMetrics
from testkit.apiserver import FakeApiServer
from tests.support import eventually

CONFIG = CertsConfig(
    mode="secret",
    mutating_webhook_configurations=["fracgpu-webhook"],
    validating_webhook_configurations=["fracgpu-webhook", "fracgpu-quota"],
)


def webhook_configuration(kind: str, name: str, webhooks: int = 2) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": kind,
        "metadata": {"name": name, "labels": {"app": "fracgpu"}},
        "webhooks": [
            {
                "name": f"w{i}.fracgpu.io",
                "clientConfig": {
                    "service": {"namespace": "fracgpu", "name": "fracgpu-webhook", "path": "/x"}
                },
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "failurePolicy": "Fail",
            }
            for i in range(webhooks)
        ],
    }


def bundles(fake: FakeApiServer, plural: str, name: str) -> list[bytes | None]:
    obj = fake.get(plural, name)
    assert obj is not None
    return [
        base64.b64decode(w["clientConfig"]["caBundle"]) if "caBundle" in w["clientConfig"] else None
        for w in obj["webhooks"]
    ]


def test_with_bundle_changes_only_the_ca_bundle() -> None:
    obj = webhook_configuration("MutatingWebhookConfiguration", "x")
    new, changed = with_bundle(obj, b"PEM")
    assert changed == 2
    assert with_bundle(new, b"PEM")[1] == 0
    assert with_bundle(new, b"OTHER")[1] == 2
    for before, after in zip(obj["webhooks"], new["webhooks"], strict=True):
        assert after["clientConfig"].pop("caBundle") == base64.b64encode(b"PEM").decode()
        assert after == before


async def test_inject_once_writes_every_webhook_and_reports_absent(
    fake: FakeApiServer, api: Any
) -> None:
    fake.put(webhook_configuration("MutatingWebhookConfiguration", "fracgpu-webhook"))
    fake.put(webhook_configuration("ValidatingWebhookConfiguration", "fracgpu-webhook", 1))
    registry = CollectorRegistry()
    injector = CaBundleInjector(api, CONFIG, CertsMetrics(registry))
    outcomes = await injector.inject(b"BUNDLE-1")
    assert [o.result for o in outcomes] == ["injected", "injected", "absent"]
    assert bundles(fake, "mutatingwebhookconfigurations", "fracgpu-webhook") == [b"BUNDLE-1"] * 2
    assert bundles(fake, "validatingwebhookconfigurations", "fracgpu-webhook") == [b"BUNDLE-1"]
    version = fake.resource_version
    outcomes = await injector.inject(b"BUNDLE-1")
    assert [o.result for o in outcomes] == ["unchanged", "unchanged", "absent"]
    assert fake.resource_version == version  # no write when nothing changes
    assert (
        registry.get_sample_value(
            "fracgpu_certs_cabundle_injections_total",
            {"kind": "MutatingWebhookConfiguration", "name": "fracgpu-webhook"},
        )
        == 1.0
    )


async def test_running_injector_follows_bundle_and_configuration_changes(
    fake: FakeApiServer, api: Any
) -> None:
    fake.put(webhook_configuration("MutatingWebhookConfiguration", "fracgpu-webhook"))
    fake.put(webhook_configuration("MutatingWebhookConfiguration", "someone-else"))
    current = [b"BUNDLE-1"]
    changed = asyncio.Event()
    task = asyncio.create_task(CaBundleInjector(api, CONFIG).run(lambda: current[0], changed))
    try:
        mutating = "mutatingwebhookconfigurations"
        await eventually(lambda: bundles(fake, mutating, "fracgpu-webhook") == [b"BUNDLE-1"] * 2)
        # A CA rotation changes the bundle.
        current[0] = b"BUNDLE-2"
        changed.set()
        await eventually(lambda: bundles(fake, mutating, "fracgpu-webhook") == [b"BUNDLE-2"] * 2)
        # `kubectl apply` of the manifest (no caBundle) overwrites the configuration.
        fake.put(webhook_configuration("MutatingWebhookConfiguration", "fracgpu-webhook", 3))
        await eventually(lambda: bundles(fake, mutating, "fracgpu-webhook") == [b"BUNDLE-2"] * 3)
        # Deleted and re-created; and a configuration that appears only now.
        fake.remove(mutating, "fracgpu-webhook")
        fake.put(webhook_configuration("MutatingWebhookConfiguration", "fracgpu-webhook", 1))
        fake.put(webhook_configuration("ValidatingWebhookConfiguration", "fracgpu-quota", 1))
        await eventually(lambda: bundles(fake, mutating, "fracgpu-webhook") == [b"BUNDLE-2"])
        await eventually(
            lambda: (
                bundles(fake, "validatingwebhookconfigurations", "fracgpu-quota") == [b"BUNDLE-2"]
            )
        )
        # Configurations that are not ours are left alone.
        assert bundles(fake, mutating, "someone-else") == [None, None]
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_running_injector_survives_conflicts_and_outages(
    fake: FakeApiServer, api: Any
) -> None:
    fake.put(webhook_configuration("MutatingWebhookConfiguration", "fracgpu-webhook"))
    fake.fail_writes("mutatingwebhookconfigurations", "fracgpu-webhook", times=2, code=409)
    changed = asyncio.Event()
    task = asyncio.create_task(CaBundleInjector(api, CONFIG).run(lambda: b"B", changed))
    try:
        mutating = "mutatingwebhookconfigurations"
        await eventually(lambda: bundles(fake, mutating, "fracgpu-webhook") == [b"B"] * 2)
        fake.down("503", seconds=0.5)
        await asyncio.sleep(0.1)
        fake.put(webhook_configuration("MutatingWebhookConfiguration", "fracgpu-webhook"))
        await eventually(lambda: bundles(fake, mutating, "fracgpu-webhook") == [b"B"] * 2, 15)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
