"""Fixtures of the e2e suite. Every test here needs a real cluster: without FRACGPU_E2E_KUBECONFIG
the whole directory is skipped, with the reason, so `make test` stays offline."""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import (
    ENV_BIND,
    ENV_HOST,
    ENV_KUBECONFIG,
    RUN_LABEL,
    Kubectl,
    LocalWebhook,
    for_local_webhook,
    registered,
    rendered_webhook_configurations,
)

SKIP_REASON = (
    f"e2e: set {ENV_KUBECONFIG} to the kubeconfig of a disposable cluster (kind, k3d, or any "
    f"cluster whose API server can reach this machine) to run it; see docs/e2e.md"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.e2e)
            if not os.environ.get(ENV_KUBECONFIG):
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="session")
def kubectl() -> Kubectl:
    kubeconfig = os.environ[ENV_KUBECONFIG]
    if not Path(kubeconfig).is_file():
        pytest.fail(f"{ENV_KUBECONFIG}={kubeconfig}: no such file")
    binary = shutil.which("kubectl")
    if binary is None:
        pytest.fail("the e2e suite drives the cluster with kubectl; put kubectl on PATH")
    kube = Kubectl(kubeconfig, binary)
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
    local = LocalWebhook(
        tmp_path_factory.mktemp(f"webhook-{run_id}"), host, bind, kubectl.kubeconfig
    )
    local.start()
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="session")
def webhook_configurations(
    kubectl: Kubectl, webhook: LocalWebhook, run_id: str
) -> Iterator[list[dict[str, object]]]:
    objs = for_local_webhook(rendered_webhook_configurations(), run_id, webhook)
    with registered(kubectl, objs):
        yield objs


@pytest.fixture()
def namespace(kubectl: Kubectl, run_id: str, webhook_configurations: object) -> Iterator[str]:
    """A fresh namespace that the run's webhook configurations select; deleted afterwards."""
    name = f"fracgpu-e2e-{run_id}-{secrets.token_hex(2)}"
    kubectl.apply(
        [
            {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": name, "labels": {RUN_LABEL: run_id}},
            }
        ]
    )
    wait_until_admission_sees(kubectl, name)
    try:
        yield name
    finally:
        kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")


def wait_until_admission_sees(kubectl: Kubectl, namespace: str, timeout: float = 30) -> None:
    """The API server picks up new webhook configurations asynchronously: dry-run a GPU pod until
    it comes back mutated (server-side dry-run runs admission and stores nothing)."""
    from tests.e2e.scenarios import gpu_pod, manifest

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
