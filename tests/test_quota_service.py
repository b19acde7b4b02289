"""open_quota: configuration, embedded mode, and readiness when the CRD is missing."""

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from core.admission import AdmissionRequest
from quota.config import QuotaConfig
from quota.service import open_quota
from tests.fakes.apiserver import FakeApiServer
from tests.fakes.kinds import DEFAULT_KINDS, GPUQUOTA
from tests.quota_pods import gpu_pod, gpu_quota, review


def test_config_rules() -> None:
    with pytest.raises(ValidationError, match="extra"):
        QuotaConfig.model_validate({"modes": "embedded"})
    with pytest.raises(ValidationError, match=r"quota\.file is read only in embedded mode"):
        QuotaConfig(file=Path("q.yaml"))
    with pytest.raises(ValidationError, match="must be shorter than lease_duration_s"):
        QuotaConfig.model_validate({"leader_election": {"renew_interval_s": 20}})
    with pytest.raises(ValidationError, match="must not exceed"):
        QuotaConfig(timeout_s=1, request_timeout_s=2)


async def test_embedded(tmp_path: Path) -> None:
    path = tmp_path / "quotas.yaml"
    path.write_text(yaml.safe_dump(gpu_quota(gpu="0.5")))
    service = await open_quota(QuotaConfig(mode="embedded", file=path), None)
    assert service.ready() is None
    await service.run()  # nothing to reconcile: returns at once
    first = await service.reviewer(AdmissionRequest.model_validate(review(gpu_pod("a", 30))))
    second = await service.reviewer(AdmissionRequest.model_validate(review(gpu_pod("b", 30))))
    assert first.allowed
    assert not second.allowed
    assert second.status is not None
    assert "allows 0.50 card (0.30 used)" in second.status.message
    await service.close()


async def test_kubernetes_mode_needs_a_client() -> None:
    with pytest.raises(ValueError, match="no Kubernetes client"):
        await open_quota(QuotaConfig(), None)


async def test_not_ready_without_the_crd() -> None:
    kinds = [k for k in DEFAULT_KINDS if k is not GPUQUOTA]
    async with FakeApiServer(kinds=kinds) as fake, fake.api_client() as api:
        service = await open_quota(QuotaConfig(), api)
        assert service.ready() == (
            "the GPUQuota CRD (gpuquotas.fracgpu.io) is not installed; apply "
            "deploy/crds/gpuquota.yaml"
        )
        fake.register(GPUQUOTA)
        await service.probe()
        assert service.ready() is None
        await service.close()
