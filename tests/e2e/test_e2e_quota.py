"""GPU quota on a real cluster, through both webhooks: the mutating one makes each pod canonical,
the validating one charges it to the namespace's GPUQuota (reserved in the GPUQuota's status with
compare-and-swap, so concurrent creates are decided one after another).

The pods ask for shares and are never scheduled (a nodeSelector nothing matches): admission and
quota need no GPU. Expected messages come from the quota code (``fracgpu review --quota``).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from core.kube import GPUQUOTAS, LEASES, PODS, KubeConflict, KubeError, call_json
from quota.config import LeaderElection
from quota.leader import LeaderElector
from quota.model import CONTROLLER_ACTIVE, COUNTED
from tests.e2e.harness import LEASE_NAMESPACE, Kubectl, LocalWebhook, Run, lease_name
from tests.e2e.scenarios import expected_quota, gpu_pod, gpu_quota, manifest
from webhook.server import METRICS_PATH

Obj = dict[str, Any]
QUOTA_WEBHOOK_KIND = "ValidatingWebhookConfiguration"


def quota_webhook(run: Run) -> str:
    (obj,) = [o for o in run.configurations if o["kind"] == QUOTA_WEBHOOK_KIND]
    name: str = obj["webhooks"][0]["name"]
    return name


async def _new_quota(api: Any, namespace: str, quota: Obj) -> None:
    """Create a GPUQuota and wait until its controller has counted the namespace: until then
    admission holds GPU pods back (up to a few seconds) and denies them as not counted yet."""
    await call_json(api, "POST", GPUQUOTAS.path(namespace), body=quota)
    name = quota["metadata"]["name"]
    for _ in range(100):
        obj = await call_json(api, "GET", GPUQUOTAS.path(namespace, name))
        conditions = (obj.get("status") or {}).get("conditions") or []
        if any(c.get("type") == COUNTED and c.get("status") == "True" for c in conditions):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"GPUQuota {namespace}/{name} was not counted within 10 s")


async def _create(api: Any, namespace: str, pod: Obj, **query: str) -> KubeError | None:
    try:
        await call_json(api, "POST", PODS.path(namespace), body=pod, query=list(query.items()))
    except KubeError as err:
        return err
    return None


async def test_denial_is_the_quota_message_as_kubectl_prints_it(
    e2e: Run, kubectl: Kubectl, kube_api: Any, namespace: str, tmp_path: Path
) -> None:
    quota = gpu_quota("team", gpu="1", gpumem="16Gi")
    first, second = gpu_pod("a", "0.5", "8Gi"), gpu_pod("b", "0.6", "4Gi")
    want = await expected_quota(tmp_path, namespace, quota, [first, second])
    assert [d.allowed for d in want] == [True, False]
    await _new_quota(kube_api, namespace, quota)
    await asyncio.to_thread(kubectl.ok, "create", "-n", namespace, "-f", "-",
                            stdin=manifest(first))  # fmt: skip
    proc = await asyncio.to_thread(
        kubectl, "create", "-n", namespace, "-f", "-", stdin=manifest(second)
    )
    assert proc.returncode != 0
    denied = f'admission webhook "{quota_webhook(e2e)}" denied the request: {want[1].message}'
    assert denied in proc.stderr


@dataclass(frozen=True)
class Burst:
    limit: str  # the GPUQuota's cards
    share: str  # each pod's fracgpu.io/gpu
    count: int  # pods created at once
    fits: int  # how many the quota holds


BURSTS = [
    pytest.param(Burst("1", "0.1", 20, 10), id="20x0.1-under-1"),
    pytest.param(Burst("2.5", "0.25", 30, 10), id="30x0.25-under-2.5"),
]


@pytest.mark.parametrize("burst", BURSTS)
async def test_concurrent_creates_are_never_over_admitted(
    kube_api: Any, namespace: str, burst: Burst
) -> None:
    quota = gpu_quota("q", gpu=burst.limit)
    await _new_quota(kube_api, namespace, quota)
    results = await asyncio.gather(
        *(_create(kube_api, namespace, gpu_pod(f"p{i}", burst.share)) for i in range(burst.count))
    )
    admitted = sum(r is None for r in results)
    listed = await call_json(kube_api, "GET", PODS.path(namespace))
    assert len(listed["items"]) == admitted
    assert admitted == burst.fits
    # Every refusal is the quota's, none a timeout or a conflict given up on.
    refusals = {r.message.partition("denied the request: ")[2][:24] for r in results if r}
    assert refusals == {"GPU quota exceeded in na"}


async def _status_text(api: Any, namespace: str, name: str) -> str:
    obj = await call_json(api, "GET", GPUQUOTAS.path(namespace, name))
    return json.dumps(obj.get("status") or {})


async def test_dry_run_is_decided_and_reserves_nothing(kube_api: Any, namespace: str) -> None:
    await _new_quota(kube_api, namespace, gpu_quota("q", gpu="1"))
    fits, too_big = gpu_pod("dry-run-fits", "1"), gpu_pod("dry-run-too-big", "2")
    assert await _create(kube_api, namespace, fits, dryRun="All") is None
    assert await _create(kube_api, namespace, too_big, dryRun="All") is not None
    # Admission records what it admits by pod name in the GPUQuota's status: not for dry runs.
    assert "dry-run-fits" not in await _status_text(kube_api, namespace, "q")
    # And nothing was held for them: the whole quota is still there for a real pod.
    assert await _create(kube_api, namespace, gpu_pod("real", "1")) is None


async def test_a_stopping_leader_hands_the_lease_over_at_once(
    kube_api: Any, e2e_namespace: str
) -> None:
    """Two replicas' electors on the real API server's Lease (coordination.k8s.io/v1): the
    leader stops and the other leads within a second or two, not a lease duration later (the
    restart that used to leave new GPUQuotas uncounted for about 15 s)."""
    config = LeaderElection(
        lease_duration_s=15.0, renew_interval_s=0.2, lease_namespace=e2e_namespace
    )
    leading: list[str] = []

    def work(name: str) -> Any:
        async def body() -> None:
            leading.append(name)
            try:
                await asyncio.Event().wait()
            finally:
                leading.remove(name)

        return body

    async def until(check: Any, within_s: float) -> bool:
        deadline = time.monotonic() + within_s
        while not check() and time.monotonic() < deadline:  # noqa: ASYNC110 - no event
            await asyncio.sleep(0.05)
        return bool(check())

    old = asyncio.create_task(
        LeaderElector(kube_api, config.model_copy(update={"identity": "old"})).run(work("old"))
    )
    assert await until(lambda: leading == ["old"], 10)
    new = asyncio.create_task(
        LeaderElector(kube_api, config.model_copy(update={"identity": "new"})).run(work("new"))
    )
    try:
        await asyncio.sleep(1.0)
        assert leading == ["old"]
        old.cancel()
        await asyncio.gather(old, return_exceptions=True)
        assert await until(lambda: leading == ["new"], 3.0)
    finally:
        new.cancel()
        await asyncio.gather(new, return_exceptions=True)


def _leading(webhook: LocalWebhook) -> bool:
    """Whether the run's replica holds its Lease, from its own metrics."""
    context = ssl.create_default_context(cadata=webhook.ca_pem.decode())
    context.check_hostname = False
    url = webhook.local_url(METRICS_PATH)
    with urllib.request.urlopen(url, context=context, timeout=5) as reply:
        text = reply.read().decode()
    return "\nfracgpu_quota_leader 1.0" in text


async def _set_holder(api: Any, path: str, holder: str) -> None:
    """Write the Lease's holder as a replica would (compare-and-swap, retried on conflict)."""
    for _ in range(20):
        lease = await call_json(api, "GET", path)
        lease["spec"].update(
            holderIdentity=holder,
            renewTime=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            leaseDurationSeconds=15,
        )
        try:
            await call_json(api, "PUT", path, body=lease)
            return
        except KubeConflict:
            continue
    raise AssertionError(f"Lease {path} kept changing")


async def _until(check: Any, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if await asyncio.to_thread(check):
            return True
        await asyncio.sleep(0.1)
    return bool(await asyncio.to_thread(check))


async def test_a_crashed_leader_holds_no_new_quota_back(
    e2e: Run, webhook: LocalWebhook, kube_api: Any, namespace: str
) -> None:
    """The leader crashed: its Lease stays held, unrenewed, for 15 s, and no controller runs.
    A GPUQuota created then is counted by the replica that decides its first pod: the pod is
    admitted within 2 s, not denied "not counted yet" until the Lease expires, and the next one
    is decided against that count."""
    path = LEASES.path(LEASE_NAMESPACE, lease_name(e2e.run_id))
    assert await _until(lambda: _leading(webhook), 10)
    await _set_holder(kube_api, path, "crashed-replica")
    try:
        assert await _until(lambda: not _leading(webhook), 5), "the replica kept leading"
        quota = gpu_quota("q", gpu="1")
        await call_json(kube_api, "POST", GPUQUOTAS.path(namespace), body=quota)
        started = time.monotonic()
        first = await _create(kube_api, namespace, gpu_pod("first", "0.6"))
        elapsed = time.monotonic() - started
        assert first is None, first.message
        assert elapsed < 2.0
        second = await _create(kube_api, namespace, gpu_pod("second", "0.6"))
        assert second is not None
        assert "GPU quota exceeded" in second.message
        obj = await call_json(kube_api, "GET", GPUQUOTAS.path(namespace, "q"))
        conditions = {c["type"]: c["status"] for c in obj["status"]["conditions"]}
        assert conditions[COUNTED] == "True"
        assert CONTROLLER_ACTIVE not in conditions  # nobody matches admissions to pods yet
    finally:
        await _set_holder(kube_api, path, "")  # as the crashed holder's Lease expiring would
        assert await _until(lambda: _leading(webhook), 10), "the replica did not lead again"
