"""Scaffolding for the end-to-end suite: a real cluster, or a clear skip.

Every test under tests/e2e runs against the cluster whose kubeconfig path is in
FRACGPU_E2E_KUBECONFIG, and is reported as skipped (with the reason) when that variable is unset,
so a machine without a cluster stays green and says why. A variable that is set but points at a
missing file is an error, not a skip: the operator asked for e2e and it cannot run.

Fixtures: ``settings`` (the variables, harness.Settings), ``e2e`` (the run: CRD, local webhook,
both webhook configurations; harness.e2e_run, once per session, removed at the end whatever
happened), ``kubectl``, ``namespace`` (a fresh namespace the run's webhooks select, deleted after
the test), ``kube_api`` (a kubernetes-asyncio ApiClient on the test's own loop) and
``e2e_namespace`` (a fresh namespace the webhooks do not select).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from core.kube import kube_client
from tests.e2e.harness import (
    ENV_KUBECONFIG,
    HarnessError,
    Kubectl,
    LocalWebhook,
    Run,
    Settings,
    create_namespace,
    delete_namespace,
    e2e_run,
    kubectl_binary,
    sigterm_interrupts,
    wait_until_admission_effective,
)
from tests.e2e.scenarios import gpu_pod

_HERE = Path(__file__).parent
SKIP_REASON = (
    f"e2e: needs a real cluster; `make e2e` builds and runs one, or set {ENV_KUBECONFIG} to a "
    "cluster's kubeconfig path (docs/testing.md)"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark everything collected under tests/e2e as `e2e` (this hook sees the whole session)."""
    for item in items:
        if _HERE in item.path.parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def settings() -> Settings:
    try:
        found = Settings.from_env(os.environ)
    except HarnessError as err:
        pytest.fail(str(err))
    if found is None:
        pytest.skip(SKIP_REASON)
    return found


@pytest.fixture(autouse=True)
def _require_cluster(settings: Settings) -> None:
    """Autouse in this directory: every test skips, with the reason, without a cluster."""


@pytest.fixture(scope="session")
def e2e(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    run_id = secrets.token_hex(3)
    workdir = tmp_path_factory.mktemp(f"e2e-{run_id}")
    try:
        with sigterm_interrupts(), e2e_run(settings, workdir, run_id) as run:
            probe = run.namespace("probe")
            run.portal.run(wait_until_admission_effective(run.api, probe, gpu_pod("probe", "0.5")))
            yield run
    except HarnessError as err:
        pytest.fail(str(err))


@pytest.fixture(scope="session")
def kubectl(settings: Settings) -> Kubectl:
    try:
        return Kubectl(settings.kubeconfig, kubectl_binary())
    except HarnessError as err:
        pytest.fail(str(err))


@pytest.fixture
def webhook(e2e: Run) -> LocalWebhook:
    return e2e.webhook


@pytest.fixture
def namespace(e2e: Run) -> Iterator[str]:
    """A fresh namespace that the run's webhook configurations select; deleted afterwards."""
    name = e2e.namespace(secrets.token_hex(2))
    try:
        yield name
    finally:
        e2e.portal.run(delete_namespace(e2e.api, name))


@pytest.fixture
async def kube_api(settings: Settings) -> AsyncIterator[Any]:
    async with kube_client(settings.kubeconfig) as api:
        yield api


@pytest.fixture
async def e2e_namespace(kube_api: Any) -> AsyncIterator[str]:
    """A namespace of the test's own that no webhook of the run selects, deleted afterwards."""
    name = f"fracgpu-e2e-plain-{secrets.token_hex(3)}"
    await create_namespace(kube_api, name, {})
    try:
        yield name
    finally:
        await delete_namespace(kube_api, name)
