"""open_quota: configuration, embedded mode, and what happens while the CRD is missing."""

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from pydantic import ValidationError

from core.admission import AdmissionRequest
from fracgpu.serve import run_server
from quota.config import QuotaConfig
from quota.service import open_quota
from testkit.apiserver import FakeApiServer
from testkit.kinds import DEFAULT_KINDS, GPUQUOTA
from testkit.quota_pods import gpu_pod, gpu_quota, review
from tests.serving import in_cluster_config, issued_ca
from tests.support import eventually, free_port


def test_config_rules() -> None:
    with pytest.raises(ValidationError, match="extra"):
        QuotaConfig.model_validate({"modes": "embedded"})
    with pytest.raises(ValidationError, match=r"quota\.file is read only in embedded mode"):
        QuotaConfig(file=Path("q.yaml"))
    with pytest.raises(ValidationError, match="must be shorter than lease_duration_s"):
        QuotaConfig.model_validate({"leader_election": {"renew_interval_s": 20}})
    with pytest.raises(ValidationError, match="must not exceed"):
        QuotaConfig(timeout_s=1, request_timeout_s=2)
    with pytest.raises(ValidationError, match=r"quota\.count_wait_s \(4\) must be shorter"):
        QuotaConfig(timeout_s=4, count_wait_s=4)


async def test_embedded(tmp_path: Path) -> None:
    path = tmp_path / "quotas.yaml"
    path.write_text(yaml.safe_dump(gpu_quota(gpu="0.5")))
    service = await open_quota(QuotaConfig(mode="embedded", file=path), None)
    assert service.problem() is None
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


async def test_without_the_crd_gpu_pods_are_denied_with_the_fix_and_it_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kinds = [k for k in DEFAULT_KINDS if k is not GPUQUOTA]
    async with FakeApiServer(kinds=kinds) as fake, fake.api_client() as api:
        service = await open_quota(QuotaConfig(leader_election={"enabled": False}), api)
        service.probe_interval_s = 0.05
        problem = service.problem()
        assert problem is not None
        assert "gpuquotas.fracgpu.io" in problem
        assert "kubectl apply -k deploy/crds" in problem
        run = asyncio.create_task(service.run())
        try:
            denied = await service.reviewer(_request(gpu_pod("a", 30)))
            assert not denied.allowed
            assert denied.status is not None
            assert denied.status.message.startswith(
                'GPU quota could not be checked in namespace "team-a": the GPUQuota CRD '
                "(gpuquotas.fracgpu.io) is not installed"
            )
            assert denied.status.message.endswith("install it with `kubectl apply -k deploy/crds`")
            await asyncio.sleep(0.3)  # several probes
            errors = [r for r in caplog.records if "is not installed" in r.getMessage()]
            assert len(errors) == 1  # logged once, not at every probe
            watches = [r for r in fake.requests if "gpuquotas" in r.path and "watch" in r.query]
            assert watches == []  # no watch retrying a 404
            fake.register(GPUQUOTA)
            await eventually(lambda: service.problem() is None)
            allowed = await service.reviewer(_request(gpu_pod("b", 30)))
            assert allowed.allowed  # no GPUQuota in team-a: not limited
        finally:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
            await service.close()


def _request(pod: dict[str, Any]) -> AdmissionRequest:
    return AdmissionRequest.model_validate(review(pod))


async def test_serve_is_ready_for_mutation_without_the_crd(tmp_path: Path) -> None:
    kinds = [k for k in DEFAULT_KINDS if k is not GPUQUOTA]
    async with FakeApiServer(kinds=kinds, namespaces=("default", "fracgpu")) as fake:
        port = free_port()
        config = in_cluster_config(fake, tmp_path, port)
        stop = asyncio.Event()
        server = asyncio.ensure_future(run_server(config, standalone=False, stop=stop))
        try:
            connector = aiohttp.TCPConnector(ssl=await issued_ca(fake))
            async with aiohttp.ClientSession(connector=connector) as http:
                statuses: list[int] = []

                async def ready() -> bool:
                    with contextlib.suppress(aiohttp.ClientConnectionError):
                        async with http.get(f"https://127.0.0.1:{port}/readyz") as resp:
                            statuses.append(resp.status)
                            return resp.status == 200
                    return False

                for _ in range(250):
                    if await ready():
                        break
                    await asyncio.sleep(0.02)
                assert statuses[-1] == 200
        finally:
            stop.set()
            assert await asyncio.wait_for(server, 10) == 0
