"""GPU quota on a real cluster (skipped unless FRACGPU_E2E_KUBECONFIG names a kubeconfig).

Needs fracgpu installed (CRD, webhooks, controller) and no GPU: the pods ask for shares and are
never scheduled (a nodeSelector nothing matches), which is enough for admission and quota.
Each test uses a namespace of its own and deletes it afterwards.
"""

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from core.kube import GPUQUOTAS, NAMESPACES, PODS, KubeError, call_json, kube_client

KUBECONFIG = os.environ.get("FRACGPU_E2E_KUBECONFIG")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not KUBECONFIG, reason="needs a real cluster (FRACGPU_E2E_KUBECONFIG)"),
]


@pytest.fixture
async def cluster() -> AsyncIterator[tuple[Any, str]]:
    namespace = f"fracgpu-e2e-quota-{uuid.uuid4().hex[:6]}"
    async with kube_client(KUBECONFIG) as api:
        body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
        await call_json(api, "POST", NAMESPACES.path(), body=body)
        try:
            yield api, namespace
        finally:
            await call_json(api, "DELETE", NAMESPACES.path(name=namespace))


def _pod(name: str, gpu: str, gpumem: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"fracgpu.io/e2e-never": "true"},
            "containers": [
                {
                    "name": "main",
                    "image": "registry.k8s.io/pause:3.9",
                    "resources": {"limits": {"fracgpu.io/gpu": gpu, "fracgpu.io/gpumem": gpumem}},
                }
            ],
        },
    }


async def _quota(api: Any, namespace: str, **spec: Any) -> None:
    body = {
        "apiVersion": "fracgpu.io/v1",
        "kind": "GPUQuota",
        "metadata": {"name": namespace},
        "spec": spec,
    }
    await call_json(api, "POST", GPUQUOTAS.path(namespace), body=body)


async def _create(api: Any, namespace: str, pod: dict[str, Any], **query: str) -> KubeError | None:
    try:
        await call_json(api, "POST", PODS.path(namespace), body=pod, query=list(query.items()))
    except KubeError as err:
        return err
    return None


async def test_denial_message_as_kubectl_prints_it(cluster: tuple[Any, str]) -> None:
    api, namespace = cluster
    await _quota(api, namespace, gpu="1", gpumem="16Gi")
    assert await _create(api, namespace, _pod("a", "0.5", "8Gi")) is None
    err = await _create(api, namespace, _pod("b", "0.6", "4Gi"))
    assert err is not None
    assert err.status == 403
    assert err.reason == "Forbidden"
    assert "denied the request: " in err.message
    assert err.message.endswith(
        f'GPU quota exceeded in namespace "{namespace}": this pod asks 0.60 card and 4096 MiB; '
        f'quota "{namespace}" allows 1.00 card (0.50 used) and 16384 MiB (8192 used)'
    )


async def test_100_concurrent_creates_never_exceed(cluster: tuple[Any, str]) -> None:
    api, namespace = cluster
    await _quota(api, namespace, gpu="2.5")
    results = await asyncio.gather(
        *(_create(api, namespace, _pod(f"p{i}", "0.1", "1024")) for i in range(100))
    )
    assert sum(r is None for r in results) == 25
    assert all(r.status == 403 for r in results if r is not None)
    listed = await call_json(api, "GET", PODS.path(namespace))
    assert len(listed["items"]) == 25


async def test_dry_run_reserves_nothing(cluster: tuple[Any, str]) -> None:
    api, namespace = cluster
    await _quota(api, namespace, gpu="1")
    before = await call_json(api, "GET", GPUQUOTAS.path(namespace, namespace))
    assert await _create(api, namespace, _pod("dry", "1", "1024"), dryRun="All") is None
    after = await call_json(api, "GET", GPUQUOTAS.path(namespace, namespace))
    assert (after.get("status") or {}).get("reservations", {}) == (before.get("status") or {}).get(
        "reservations", {}
    )
    assert await _create(api, namespace, _pod("real", "1", "1024")) is None
