"""Scaffolding for the end-to-end suite: a real cluster, or a clear skip.

Every test under tests/e2e runs against the cluster whose kubeconfig path is in
FRACGPU_E2E_KUBECONFIG, and is reported as skipped (with the reason) when that variable is unset,
so `make test` on a machine without a cluster stays green and says why. A variable that is set but
points at a missing file is an error, not a skip: the operator asked for e2e and it cannot run.

Fixtures: `e2e_kubeconfig` (the path), `kube_api` (a kubernetes-asyncio ApiClient for it, closed
after the test) and `e2e_namespace` (a fresh namespace, deleted after the test).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from webhook.kube import NAMESPACES, KubeError, call_json, kube_client

E2E_ENV = "FRACGPU_E2E_KUBECONFIG"
_HERE = Path(__file__).parent
SKIP_REASON = (
    f"e2e: needs a real cluster; set {E2E_ENV} to its kubeconfig path "
    "(see docs/testing.md for kind, k3d or any cluster)"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark everything collected under tests/e2e as `e2e` (this hook sees the whole session)."""
    for item in items:
        if _HERE in item.path.parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(autouse=True)
def _require_cluster() -> None:
    """Autouse in this directory only: skip with the reason when no cluster is configured."""
    if not os.environ.get(E2E_ENV):
        pytest.skip(SKIP_REASON)


@pytest.fixture
def e2e_kubeconfig() -> Path:
    path = Path(os.environ[E2E_ENV]).expanduser()
    if not path.is_file():
        pytest.fail(f"{E2E_ENV}={str(path)!r} is not a file; point it at a kubeconfig")
    return path


@pytest.fixture
async def kube_api(e2e_kubeconfig: Path) -> AsyncIterator[Any]:
    async with kube_client(e2e_kubeconfig) as api:
        yield api


@pytest.fixture
async def e2e_namespace(kube_api: Any) -> AsyncIterator[str]:
    """A namespace of the test's own (labelled so leftovers can be found), deleted afterwards."""
    name = f"fracgpu-e2e-{secrets.token_hex(3)}"
    body = {"metadata": {"name": name, "labels": {"fracgpu.io/e2e": "true"}}}
    await call_json(kube_api, "POST", NAMESPACES.path(), body=body)
    try:
        yield name
    finally:
        try:
            await call_json(kube_api, "DELETE", NAMESPACES.path(name=name))
        except KubeError as err:
            if err.status != 404:
                raise
