"""GPUQuota stays small at any number of pods, with and without its controller, and keeps its
guarantees: no over-admission, admissions matched to pods, what never existed or ended released
on time, a new or unreadable quota counted before it is used.

The real kubernetes-asyncio client against the fake API server over HTTP; pods are persisted
with the UID that admission saw, as kube-apiserver does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import pytest

from core.admission import AdmissionRequest
from quota.config import QuotaConfig
from quota.controller import UsageController
from quota.service import QuotaService, open_quota
from quota.store import Unavailable
from testkit.apiserver import FakeApiServer
from testkit.quota_pods import counted_quota, gpu_pod, gpu_quota, review
from tests.support import eventually

# "A few KB": the largest status write any test here may see.
MAX_WRITE_BYTES = 8 * 1024


@pytest.fixture
async def fake() -> AsyncIterator[FakeApiServer]:
    async with FakeApiServer(namespaces=("default", "team-a")) as server:
        yield server


async def _service(stack: AsyncExitStack, fake: FakeApiServer, **config: Any) -> QuotaService:
    api = await stack.enter_async_context(fake.api_client())
    config.setdefault("leader_election", {"enabled": False})
    service = await open_quota(QuotaConfig(**config), api)
    stack.push_async_callback(service.close)
    return service


async def _controller(
    stack: AsyncExitStack, service: QuotaService, **kwargs: Any
) -> UsageController:
    """The service's controller running its real loop (events, timers) in the background."""
    controller = service.controller()
    for key, value in kwargs.items():
        setattr(controller, key, value)
    task = asyncio.create_task(controller.run())

    async def stop() -> None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    stack.push_async_callback(stop)
    await controller.pods.wait_synced(5)
    await controller.quotas.wait_synced(5)
    return controller


def _request(pod: dict[str, Any]) -> AdmissionRequest:
    return AdmissionRequest.model_validate(review(pod))


def _status(fake: FakeApiServer, name: str = "team-a") -> dict[str, Any]:
    obj = fake.get("gpuquotas", name, "team-a")
    assert obj is not None
    status: dict[str, Any] = obj.get("status") or {}
    return status


def _largest_status_write(fake: FakeApiServer) -> int:
    return max(
        (r.body_bytes for r in fake.requests if r.method == "PUT" and r.path.endswith("/status")),
        default=0,
    )


def _counted(fake: FakeApiServer, name: str = "team-a") -> bool:
    conditions = _status(fake, name).get("conditions") or []
    return any(c["type"] == "Counted" and c["status"] == "True" for c in conditions)


async def test_without_controller_the_status_stays_small_and_says_so(
    fake: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    fake.put(counted_quota(gpu=100))
    async with AsyncExitStack() as stack:
        service = await _service(stack, fake, stale_after_s=0.2)
        pods = [gpu_pod(f"p{i}", 10, 4) for i in range(600)]
        answers = await asyncio.gather(*(service.reviewer(_request(pod)) for pod in pods))
        assert sum(a.allowed for a in answers) == 600
        status = _status(fake)
        assert status["used"]["core"] == 6000
        assert len(status["pending"]) == 8
        assert status["unmatched"]["pods"] == 592
        assert len(json.dumps(status)) < MAX_WRITE_BYTES
        assert _largest_status_write(fake) < MAX_WRITE_BYTES
        # No controller matches them: once the oldest is older than stale_after_s, the next
        # admissions say so on the quota, in a metric and (once) in the log.
        await asyncio.sleep(0.3)
        for index in range(3):
            assert (await service.reviewer(_request(gpu_pod(f"late{index}", 10, 4)))).allowed
        conditions = {c["type"]: c for c in _status(fake)["conditions"]}
        assert conditions["ControllerActive"]["status"] == "False"
        assert "not been matched to pods" in conditions["ControllerActive"]["message"]
        age = service.metrics.unmatched_age.labels("team-a", "team-a")._value.get()
        assert age > 0.2
        warnings = [r for r in caplog.records if "not being matched" in r.getMessage()]
        assert len(warnings) == 1
        # A denial tells the user that ended pods may still count.
        full = await service.reviewer(_request(gpu_pod("big", 5000, 4)))
        assert full.status is not None
        assert "the fracgpu quota controller is not running" in full.status.message


@pytest.mark.parametrize(
    ("pods", "replicas", "pending_limit"),
    [
        pytest.param(400, 2, 32, id="400-pods-2-replicas"),
        pytest.param(400, 2, 4, id="400-pods-2-replicas-tiny-pending"),
    ],
)
async def test_burst_across_replicas_with_controller_never_over_admits(
    fake: FakeApiServer, pods: int, replicas: int, pending_limit: int
) -> None:
    fit = pods * 9 // 10
    fake.put(gpu_quota(gpu=f"{fit * 10 / 100:.2f}"))
    async with AsyncExitStack() as stack:
        services = [
            await _service(stack, fake, pending_limit=pending_limit) for _ in range(replicas)
        ]
        await _controller(stack, services[0])
        await eventually(lambda: _counted(fake))
        manifests = [gpu_pod(f"p{i}", 10, 4) for i in range(pods)]
        gate = asyncio.Semaphore(32)

        async def create(index: int) -> bool:
            async with gate:
                answer = await services[index % replicas].reviewer(_request(manifests[index]))
            if answer.allowed:
                fake.put(manifests[index])  # persisted after admission, UID kept
            return answer.allowed

        allowed = await asyncio.gather(*(create(i) for i in range(pods)))
        assert sum(allowed) == fit  # none over, and none lost to double counting
        assert len(fake.objects("pods", "team-a")) == fit
        assert _largest_status_write(fake) < MAX_WRITE_BYTES
        # The controller matches every admission to its pod: usage is exactly the pods.
        await eventually(lambda: not _status(fake)["pending"] and "unmatched" not in _status(fake))
        assert _status(fake)["used"]["core"] == fit * 10


async def test_unmatched_admissions_are_matched_to_the_pods_that_appear(
    fake: FakeApiServer,
) -> None:
    fake.put(gpu_quota(gpu=10))
    async with AsyncExitStack() as stack:
        service = await _service(stack, fake, pending_limit=2)
        controller = service.controller()
        controller.pods.start()
        controller.quotas.start()
        stack.push_async_callback(controller.pods.stop)
        stack.push_async_callback(controller.quotas.stop)
        await controller.pods.wait_synced(5)
        await controller.reconcile_all()  # counts the new quota
        pods = [gpu_pod(f"p{i}", 50, 4) for i in range(6)]
        for pod in pods:
            assert (await service.reviewer(_request(pod))).allowed
        assert _status(fake)["unmatched"]["pods"] == 4
        for pod in pods[:5]:
            fake.put(pod)
        await eventually(lambda: len(controller.pods.objects("team-a")) == 5)
        await controller.reconcile_all()
        status = _status(fake)
        # Five pods seen; the sixth is still on its way: charged once each, not twice.
        assert status["used"]["core"] == 300
        assert status["used"]["pods"] == 6
        assert [entry["uid"] for entry in status["pending"]] == [pods[5]["metadata"]["uid"]]
        assert "unmatched" not in status


async def test_unmatched_is_dropped_only_against_a_live_list_of_pods(fake: FakeApiServer) -> None:
    """When `unmatched` falls due, the pods it stood for are counted from a live list: a
    controller whose cache lags (here: never started) must not lose them."""
    fake.put(counted_quota(gpu=1))
    async with AsyncExitStack() as stack:
        service = await _service(stack, fake, pending_limit=1, reservation_grace_s=0.05)
        pods = [gpu_pod(f"p{i}", 40, 4) for i in range(2)]
        for pod in pods:
            assert (await service.reviewer(_request(pod))).allowed
            fake.put(pod)
        assert _status(fake)["unmatched"]["pods"] == 1
        await asyncio.sleep(0.1)  # both admissions are older than the grace now
        lagging = service.controller()  # its pod cache is empty: it has not synced
        await lagging.reconcile_all()
        status = _status(fake)
        assert "unmatched" not in status
        assert status["used"]["core"] == 80  # both pods, though the cache shows neither
        assert not (await service.reviewer(_request(gpu_pod("third", 40, 4)))).allowed


@pytest.mark.parametrize(
    ("old_cards", "admitted"),
    [pytest.param(5, 0, id="existing-pods-fill-it"), pytest.param(1, 2, id="room-for-two")],
)
async def test_a_quota_no_controller_counts_is_counted_by_admission(
    fake: FakeApiServer, old_cards: int, admitted: int
) -> None:
    """No controller runs (the leader crashed; its Lease has not expired): the pods of a new
    quota are not denied as "not counted yet" until it expires, the replica counts the quota
    from the pods it lists and decides them against that count, within count_wait_s."""
    for index in range(old_cards):
        fake.put(gpu_pod(f"old{index}", 100, 4))
    async with AsyncExitStack() as stack:
        service = await _service(stack, fake, count_wait_s=2.0)
        fake.put(gpu_quota(gpu=2))
        started = time.monotonic()
        burst = await asyncio.gather(
            *(service.reviewer(_request(gpu_pod(f"n{i}", 50, 4))) for i in range(4))
        )
        assert time.monotonic() - started < 2.0
        assert sum(a.allowed for a in burst) == admitted
        denied = next(a for a in burst if not a.allowed)
        assert denied.status is not None
        assert "allows 2.00 cards" in denied.status.message
        assert _counted(fake)
        conditions = {c["type"] for c in _status(fake)["conditions"]}
        assert "ControllerActive" not in conditions  # counted, but nobody matches admissions
        assert service.metrics.first_counts._value.get() == 1


async def test_a_quota_that_cannot_be_counted_is_denied_as_not_known(
    fake: FakeApiServer,
) -> None:
    """Where the replica cannot count either (its pod list fails), the pod is denied with the
    message that says the quota is not counted yet, not admitted unaccounted."""
    for index in range(5):
        fake.put(gpu_pod(f"old{index}", 100, 4))
    async with AsyncExitStack() as stack:
        service = await _service(stack, fake, count_wait_s=0.4)

        async def cannot(raw: Any) -> None:
            raise Unavailable("pods of team-a: connection refused")

        service.reserver.counter = cannot
        fake.put(gpu_quota(gpu=2))
        denied = await service.reviewer(_request(gpu_pod("n", 50, 4)))
        assert denied.status is not None
        assert denied.status.message.startswith(
            'GPU quota not yet known in namespace "team-a": GPUQuota "team-a/team-a" has not '
            "been counted yet"
        )
        await _controller(stack, service)
        await eventually(lambda: _counted(fake))
        after = await service.reviewer(_request(gpu_pod("after", 50, 4)))
        assert after.status is not None
        assert "allows 2.00 cards (5.00 used)" in after.status.message


async def test_pods_applied_with_their_new_quota_wait_for_the_count(fake: FakeApiServer) -> None:
    """One `kubectl apply` of a GPUQuota and its pods: the first pods wait (up to count_wait_s)
    for the controller to count the quota, and are then decided against it, not denied."""
    async with AsyncExitStack() as stack:
        service = await _service(stack, fake, count_wait_s=3.0)
        fake.put(gpu_quota(gpu=1))
        pending = [
            asyncio.ensure_future(service.reviewer(_request(gpu_pod(f"n{i}", 40, 4))))
            for i in range(3)
        ]
        await asyncio.sleep(0.3)
        await _controller(stack, service)  # starts late: the pods are waiting meanwhile
        answers = await asyncio.gather(*pending)
        assert [a.allowed for a in answers] == [True, True, False]
        assert answers[2].status is not None
        assert "allows 1.00 card (0.80 used)" in answers[2].status.message


async def test_unreadable_status_is_rebuilt_from_the_pods(fake: FakeApiServer) -> None:
    quota = counted_quota(gpu=2)
    quota["status"]["used"] = {"core": "lots"}
    fake.put(quota)
    fake.put(gpu_pod("old", 100, 4))
    async with AsyncExitStack() as stack:
        service = await _service(stack, fake)
        denied = await service.reviewer(_request(gpu_pod("a", 50, 4)))
        assert denied.status is not None
        assert "status is not readable" in denied.status.message
        await _controller(stack, service)
        await eventually(lambda: _status(fake)["used"].get("core") == 100)
        assert (await service.reviewer(_request(gpu_pod("b", 50, 4)))).allowed


@pytest.mark.parametrize(
    ("persist", "delete"),
    [
        pytest.param(False, False, id="never-created-released-at-the-grace"),
        pytest.param(True, True, id="deleted-at-once-released-without-waiting"),
    ],
)
async def test_release_runs_on_its_own_timer(
    fake: FakeApiServer, persist: bool, delete: bool
) -> None:
    fake.put(gpu_quota(gpu=1))
    grace = 0.5
    async with AsyncExitStack() as stack:
        service = await _service(stack, fake, reservation_grace_s=grace)
        # No periodic pass can help: only the grace timer and the pod events.
        await _controller(stack, service, resync_s=3600.0)
        await eventually(lambda: _counted(fake))
        pod = gpu_pod("short", 100, 4)
        assert (await service.reviewer(_request(pod))).allowed
        admitted = time.monotonic()
        if persist:
            fake.put(pod)
        if delete:
            fake.remove("pods", "short", "team-a")
        await eventually(lambda: _status(fake)["used"]["core"] == 0, within_s=5)
        released_after = time.monotonic() - admitted
        if delete:
            assert released_after < grace  # ended: no need to wait for the grace
        else:
            assert released_after >= grace
        assert released_after < grace + 2.0
        assert (await service.reviewer(_request(gpu_pod("next", 100, 4)))).allowed


async def test_lease_failure_is_logged_once_and_counted(
    fake: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    election = {"lease_namespace": "missing", "lease_duration_s": 0.5, "renew_interval_s": 0.05}
    async with AsyncExitStack() as stack:
        service = await _service(stack, fake, leader_election=election)
        run = asyncio.create_task(service.run())
        try:
            await eventually(lambda: service.metrics.lease_errors.labels("404")._value.get() >= 3)
        finally:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
        errors = [r for r in caplog.records if "cannot use its Lease" in r.getMessage()]
        assert len(errors) == 1
        assert "does namespace 'missing' exist?" in errors[0].getMessage()
        assert service.metrics.controller_seen._value.get() == 0
