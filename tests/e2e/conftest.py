"""Scaffolding for the end-to-end suite: a real cluster, or a clear skip.

Every test under tests/e2e runs against the cluster whose kubeconfig path is in
FRACGPU_E2E_KUBECONFIG, and is reported as skipped (with the reason) when that variable is unset,
so `make test` on a machine without a cluster stays green and says why. A variable that is set but
points at a missing file is an error, not a skip: the operator asked for e2e and it cannot run.

Fixtures: `e2e_kubeconfig` (the path), `kube_api` (a kubernetes-asyncio ApiClient for it, closed
after the test) and `e2e_namespace` (a fresh namespace, deleted after the test). For the admission
scenarios (docs/e2e.md): `kubectl`, `webhook` (a local `fracgpu serve` the API server calls by
URL), `webhook_configurations` (deploy/'s, registered for it) and `namespace` (one they select).
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from core.kube import NAMESPACES, KubeError, call_json, kube_client
from tests.e2e.harness import (
    ENV_BIND,
    ENV_HOST,
    RUN_LABEL,
    Kubectl,
    LocalWebhook,
    for_local_webhook,
    registered,
    rendered_webhook_configurations,
)
from tests.e2e.scenarios import gpu_pod, manifest

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


# --- admission scenarios (tests/e2e/test_e2e_admission.py, docs/e2e.md) -------------------------
# A local `fracgpu serve` that the cluster's API server calls by URL, and the webhook
# configurations of deploy/ registered for it, once per session.


@pytest.fixture(scope="session")
def kubectl() -> Kubectl:
    if not os.environ.get(E2E_ENV):
        pytest.skip(SKIP_REASON)
    kubeconfig = Path(os.environ[E2E_ENV]).expanduser()
    if not kubeconfig.is_file():
        pytest.fail(f"{E2E_ENV}={str(kubeconfig)!r} is not a file; point it at a kubeconfig")
    binary = shutil.which("kubectl")
    if binary is None:
        pytest.fail("the admission scenarios drive the cluster with kubectl; put it on PATH")
    kube = Kubectl(str(kubeconfig), binary)
    kube.ok("version")
    return kube


@pytest.fixture(scope="session")
def run_id() -> str:
    return secrets.token_hex(3)


@pytest.fixture(scope="session")
def webhook(
    kubectl: Kubectl, run_id: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalWebhook]:
    host = os.environ.get(ENV_HOST, "127.0.0.1")
    bind = os.environ.get(ENV_BIND, host if host in ("127.0.0.1", "::1") else "0.0.0.0")
    workdir = tmp_path_factory.mktemp(f"webhook-{run_id}")
    local = LocalWebhook(workdir, host, bind, kubectl.kubeconfig)
    local.start()
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="session")
def webhook_configurations(
    kubectl: Kubectl, webhook: LocalWebhook, run_id: str
) -> Iterator[list[dict[str, Any]]]:
    objs = for_local_webhook(rendered_webhook_configurations(), run_id, webhook)
    with registered(kubectl, objs):
        yield objs


@pytest.fixture()
def namespace(kubectl: Kubectl, run_id: str, webhook_configurations: object) -> Iterator[str]:
    """A fresh namespace that the run's webhook configurations select; deleted afterwards."""
    name = f"fracgpu-e2e-{run_id}-{secrets.token_hex(2)}"
    labels = {RUN_LABEL: run_id, "fracgpu.io/e2e": "true"}
    kubectl.apply(
        [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}]
    )
    wait_until_admission_sees(kubectl, name)
    try:
        yield name
    finally:
        kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")


def wait_until_admission_sees(kubectl: Kubectl, namespace: str, timeout: float = 30) -> None:
    """The API server picks up new webhook configurations asynchronously: dry-run a GPU pod until
    it comes back mutated (server-side dry run runs admission and stores nothing)."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        proc = kubectl(
            "create",
            "--dry-run=server",
            "-o",
            "json",
            "-n",
            namespace,
            "-f",
            "-",
            stdin=manifest(gpu_pod("probe", "0.1")),
        )
        if proc.returncode == 0 and "fracgpu.io/core" in proc.stdout:
            return
        last = proc.stderr or proc.stdout[-500:]
        time.sleep(0.5)
    pytest.fail(f"the webhook configurations did not take effect in {timeout}s: {last}")
