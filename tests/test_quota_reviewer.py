"""The /validate reviewer in the admission server: only GPU pod creates meet quota."""

from collections.abc import Iterable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from quota.claims import ClaimSpecs, Ref
from quota.metrics import QuotaMetrics
from quota.reserver import Reserver
from quota.reviewer import QuotaReviewer
from quota.store import MemoryStore
from testkit.quota_pods import counted_quota, gpu_pod, plain_pod, review
from webhook.server import build_app


async def _post(client: TestClient[Any, Any], request: dict[str, Any]) -> dict[str, Any]:
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}
    response = await client.post("/validate", json=body)
    assert response.status == 200
    result: dict[str, Any] = (await response.json())["response"]
    return result


async def test_validate_endpoint() -> None:
    store = MemoryStore([counted_quota(gpu=1)])
    metrics = QuotaMetrics(CollectorRegistry())
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


class _NoTemplates(ClaimSpecs):
    """Specs as a replica sees them that planned none of the pod's templates: none exist yet."""

    async def load(self, refs: Iterable[Ref]) -> None:
        for ref in refs:
            self._specs[ref] = None


def _claiming_pod(name: str, template: str) -> dict[str, Any]:
    pod = plain_pod(name)
    pod["spec"]["resourceClaims"] = [{"name": "gpu-0", "resourceClaimTemplateName": template}]
    pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu-0"}]}
    return pod


@pytest.mark.parametrize(
    ("template", "dry_run", "allowed"),
    [
        pytest.param("fracgpu-cards-2", True, True, id="dry run of our template: not checked"),
        pytest.param("fracgpu-cards-2", False, False, id="a real create needs the template"),
        pytest.param("someone-elses", True, False, id="a template we do not make"),
    ],
)
async def test_claims_that_cannot_be_read(template: str, dry_run: bool, allowed: bool) -> None:
    store = MemoryStore([counted_quota(gpu=1)])
    metrics = QuotaMetrics(CollectorRegistry())
    reviewer = QuotaReviewer(Reserver(store, metrics=metrics), metrics, claims=_NoTemplates(None))
    async with TestClient(TestServer(build_app({"/validate": reviewer}))) as client:
        answer = await _post(client, review(_claiming_pod("p", template), dry_run=dry_run))
    assert answer["allowed"] is allowed
