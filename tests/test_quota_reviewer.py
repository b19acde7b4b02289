"""The /validate reviewer in the admission server: only GPU pod creates meet quota."""

from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from quota.metrics import QuotaMetrics
from quota.reserver import Reserver
from quota.reviewer import QuotaReviewer
from quota.store import MemoryStore
from tests.quota_pods import counted_quota, gpu_pod, plain_pod, review
from webhook.server import build_app


async def _post(client: TestClient[Any, Any], request: dict[str, Any]) -> dict[str, Any]:
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}
    response = await client.post("/validate", json=body)
    assert response.status == 200
    result: dict[str, Any] = (await response.json())["response"]
    return result


async def test_validate_endpoint() -> None:
    store = MemoryStore([counted_quota(gpu=1)])
    metrics = QuotaMetrics()
    reviewer = QuotaReviewer(Reserver(store, metrics=metrics), metrics)
    async with TestClient(TestServer(build_app({"/validate": reviewer}))) as client:
        first = await _post(client, review(gpu_pod("a", 60, 8)))
        assert first["allowed"] is True
        second = await _post(client, review(gpu_pod("b", 60, 8)))
        assert second["allowed"] is False
        assert second["status"]["reason"] == "Forbidden"
        assert second["status"]["message"].startswith('GPU quota exceeded in namespace "team-a"')
        assert (await _post(client, review(plain_pod("c"))))["allowed"] is True
        deleted = review(gpu_pod("d", 100, 8), operation="DELETE")
        assert (await _post(client, deleted))["allowed"] is True
    assert metrics.decisions.labels("denied", "exceeded")._value.get() == 1
