"""Managed certificates in a Secret, against the strict fake API server with the real client."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import config as kube_config

from certs.config import CertsConfig
from certs.material import Material
from certs.rotation import Request
from certs.secretstore import SecretStore
from certs.sources import ManagedSource
from certs.stores import StoreConflict
from testkit.apiserver import DEFAULT_NAMESPACES, FakeApiServer

NS = "fracgpu"
NAME = "fracgpu-webhook-tls"
CONFIG = CertsConfig(mode="secret", namespace=NS, secret_name=NAME)


@pytest.fixture
async def fake() -> AsyncIterator[FakeApiServer]:
    async with FakeApiServer(namespaces=(*DEFAULT_NAMESPACES, NS)) as server:
        yield server


@pytest.fixture
async def kubeconfig(fake: FakeApiServer, tmp_path: Path) -> Path:
    return fake.kubeconfig(tmp_path / "kubeconfig")


async def _client(kubeconfig: Path) -> Any:
    return await kube_config.new_client_from_config(
        config_file=str(kubeconfig), persist_config=False
    )


def _stored(fake: FakeApiServer) -> Material:
    obj = fake.get("secrets", NAME, NS)
    assert obj is not None
    return Material.from_files({k: base64.b64decode(v) for k, v in obj["data"].items()})


def _creates(fake: FakeApiServer) -> int:
    return sum(1 for r in fake.requests if r.method == "POST" and r.path.endswith("/secrets"))


async def test_first_start_creates_a_tls_secret(fake: FakeApiServer, kubeconfig: Path) -> None:
    async with await _client(kubeconfig) as api:
        material = await ManagedSource(
            SecretStore(api, NS, NAME), CONFIG, standalone=False
        ).ensure()
    obj = fake.get("secrets", NAME, NS)
    assert obj is not None
    assert obj["type"] == "kubernetes.io/tls"
    assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "fracgpu"
    assert _stored(fake) == material


@pytest.mark.parametrize("replicas", [2, 5], ids=["2-replicas", "5-replicas"])
async def test_replicas_starting_together_all_use_the_winners_certificates(
    fake: FakeApiServer, kubeconfig: Path, replicas: int
) -> None:
    fake.latency = 0.02  # widens the window in which every replica sees "absent"
    clients = [await _client(kubeconfig) for _ in range(replicas)]
    try:
        sources = [
            ManagedSource(SecretStore(api, NS, NAME), CONFIG, standalone=False) for api in clients
        ]
        results = await asyncio.gather(*(s.ensure() for s in sources))
    finally:
        for api in clients:
            await api.close()
    stored = _stored(fake)
    assert all(m == stored for m in results)
    assert len({m.serving.cert.serial_number for m in results}) == 1
    # Every replica saw no Secret and tried to create one; the API server let one win.
    assert _creates(fake) == replicas


async def test_concurrent_rotation_renews_once(fake: FakeApiServer, kubeconfig: Path) -> None:
    clients = [await _client(kubeconfig) for _ in range(3)]
    try:
        sources = [
            ManagedSource(SecretStore(api, NS, NAME), CONFIG, standalone=False) for api in clients
        ]
        first = await sources[0].ensure()
        fake.latency = 0.02
        # Every replica finds the CA due at once (as they would at its renew point).
        later = first.ca.cert.not_valid_after_utc - CONFIG.ca_renew_before
        for s in sources:
            s.clock = lambda: later
        results = await asyncio.gather(*(s.ensure() for s in sources))
    finally:
        for api in clients:
            await api.close()
    stored = _stored(fake)
    assert all(m == stored for m in results)
    assert stored.ca != first.ca
    # One rotation: the new CA and the old one (overlap); a second winner would add a third.
    assert stored.trusted == (stored.ca.cert, first.ca.cert)
    assert sum(1 for r in fake.requests if r.method == "PUT") == 3


async def test_a_lost_write_rereads_and_applies_the_request_to_the_winners_state(
    fake: FakeApiServer, kubeconfig: Path
) -> None:
    async with await _client(kubeconfig) as api:
        source = ManagedSource(SecretStore(api, NS, NAME), CONFIG, standalone=False)
        first = await source.ensure()
        fake.fail_writes("secrets", NAME, NS, times=2, code=409)
        after = await source.ensure(Request(serving=True))
    assert after == _stored(fake)
    assert after.ca == first.ca
    assert after.serving != first.serving
    puts = [r for r in fake.requests if r.method == "PUT"]
    assert len(puts) == 3  # two lost to the forced conflicts, the third written


async def test_a_store_that_keeps_changing_is_an_error(
    fake: FakeApiServer, kubeconfig: Path
) -> None:
    async with await _client(kubeconfig) as api:
        source = ManagedSource(SecretStore(api, NS, NAME), CONFIG, standalone=False)
        await source.ensure()
        fake.fail_writes("secrets", NAME, NS, times=100, code=409)
        with pytest.raises(StoreConflict, match="kept changing"):
            await source.ensure(Request(serving=True))


async def test_an_empty_precreated_secret_is_filled_keeping_its_metadata(
    fake: FakeApiServer, kubeconfig: Path
) -> None:
    fake.put(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": NAME,
                "namespace": NS,
                "labels": {"team": "platform"},
                "annotations": {"note": "made by the chart"},
            },
            "type": "Opaque",
        }
    )
    async with await _client(kubeconfig) as api:
        material = await ManagedSource(
            SecretStore(api, NS, NAME), CONFIG, standalone=False
        ).ensure()
    obj = fake.get("secrets", NAME, NS)
    assert obj is not None
    assert obj["metadata"]["labels"]["team"] == "platform"
    assert obj["metadata"]["annotations"] == {"note": "made by the chart"}
    assert obj["type"] == "Opaque"
    assert _stored(fake) == material


async def test_corrupt_secret_is_replaced(fake: FakeApiServer, kubeconfig: Path) -> None:
    fake.put(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": NAME, "namespace": NS},
            "type": "kubernetes.io/tls",
            "data": {
                "tls.crt": base64.b64encode(b"garbage").decode(),
                "tls.key": base64.b64encode(b"garbage").decode(),
            },
        }
    )
    async with await _client(kubeconfig) as api:
        material = await ManagedSource(
            SecretStore(api, NS, NAME), CONFIG, standalone=False
        ).ensure()
    assert _stored(fake) == material


async def test_secret_deleted_between_read_and_write_is_recreated(
    fake: FakeApiServer, kubeconfig: Path
) -> None:
    async with await _client(kubeconfig) as api:
        store = SecretStore(api, NS, NAME)
        source = ManagedSource(store, CONFIG, standalone=False)
        await source.ensure()
        files, version = await store.load()
        assert files is not None
        fake.remove("secrets", NAME, NS)
        with pytest.raises(StoreConflict):
            await store.save(files, version)
        material = await source.ensure()
    assert _stored(fake) == material
