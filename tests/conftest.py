"""Fixtures shared by several suites: the fake API server with a client, the native test kit.

Also marks the suites that take seconds of wall-clock time ``slow``, so that ``make test-fast``
(``-m "not slow"``) keeps the edit-test loop well under a minute; ``make test`` runs them all.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import config as kube_config

from core.kube import kube_client
from testkit.apiserver import DEFAULT_NAMESPACES, FakeApiServer
from testkit.native_kit import Kit, sanitized_kit

# Suites whose tests sample real time (throttling), validate manifests against every Kubernetes
# version's schemas, start real servers and subprocesses, or build and run native binaries.
SLOW_SUITES = frozenset(
    {
        "test_native_throttle.py",
        "test_native_share.py",
        "test_native_interpose.py",
        "test_native_memory.py",
        "test_native_limits.py",
        "test_deploy_manifests.py",
        "test_deploy_webhooks.py",
        "test_deploy_serve.py",
        "test_deploy_e2e_harness.py",
        "test_deviceplugin_service.py",
        "test_deviceplugin_health.py",
        "test_fakes_apiserver.py",
        "test_fakes_kubelet.py",
        "test_bench_deviceplugin.py",
        "test_quota_bench.py",
        "test_certs_hotreload.py",
        "test_certs_rotation.py",
        "test_certs_serving.py",
        "test_webhook_server.py",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SLOW_SUITES or "e2e" in item.path.parts:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
async def fake() -> AsyncIterator[FakeApiServer]:
    """A fresh fake API server; suites that need other options define their own ``fake``."""
    async with FakeApiServer(bookmark_interval=0.2) as server:
        yield server


@pytest.fixture
async def api(fake: FakeApiServer, tmp_path: Path) -> AsyncIterator[Any]:
    """The real kubernetes-asyncio client, configured by a kubeconfig that points at ``fake``."""
    path = fake.kubeconfig(tmp_path / "kubeconfig")
    client = await kube_config.new_client_from_config(config_file=str(path), persist_config=False)
    async with client:
        yield client


@pytest.fixture
async def team_api(tmp_path: Path) -> AsyncIterator[Any]:
    """A client on a fresh fake cluster that has the namespace ``team-a`` (where the GPU pods,
    claims and templates of the DRA and quota tests live)."""
    async with (
        FakeApiServer(namespaces=(*DEFAULT_NAMESPACES, "team-a")) as fake,
        kube_client(fake.kubeconfig(tmp_path / "kubeconfig")) as client,
    ):
        yield client


@pytest.fixture
def kit() -> Iterator[Kit]:
    """The sanitizer build of the hook with the fake driver, reset around each test."""
    k = sanitized_kit()
    k.reset()
    yield k
    k.reset()
