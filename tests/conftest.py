"""Fixtures shared by several suites: the fake API server with a client, the native test kit."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import config as kube_config

from tests.fakes.apiserver import FakeApiServer
from tests.fakes.native_kit import Kit, sanitized_kit


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
def kit() -> Iterator[Kit]:
    """The sanitizer build of the hook with the fake driver, reset around each test."""
    k = sanitized_kit()
    k.reset()
    yield k
    k.reset()
