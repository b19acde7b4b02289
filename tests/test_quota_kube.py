"""GPU quota in Kubernetes mode: the real kubernetes-asyncio client against the fake API server.

Admission reviews go over real HTTP to two webhook replicas (two apps, two clients, no shared
cache); GPUQuota status and pods live in the fake, which enforces resourceVersion CAS.
"""

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from functools import partial
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from core.informer import Informers
from quota.config import LeaderElection, QuotaConfig
from quota.controller import UsageController
from quota.leader import LeaderElector
from quota.service import QuotaService, open_quota
from testkit.apiserver import FakeApiServer
from testkit.quota_pods import counted_quota, gpu_pod, gpu_quota, plain_pod, review
from webhook.server import build_app
from webhook.waitwatch import WaitExplainer

NAMESPACES = ("default", "team-a", "team-b", "fracgpu-system")


@pytest.fixture
async def fake() -> AsyncIterator[FakeApiServer]:
    async with FakeApiServer(namespaces=NAMESPACES) as server:
        yield server


async def _service(stack: AsyncExitStack, fake: FakeApiServer, **config: Any) -> QuotaService:
    api = await stack.enter_async_context(fake.api_client())
    service = await open_quota(QuotaConfig(**config), api)
    stack.push_async_callback(service.close)
    return service


async def _replica(stack: AsyncExitStack, fake: FakeApiServer, **config: Any) -> str:
    """One webhook replica over HTTP; its URL."""
    service = await _service(stack, fake, **config)
    server = TestServer(build_app({"/validate": service.reviewer}))
    await server.start_server()
    stack.push_async_callback(server.close)
    return str(server.make_url("/validate"))


async def _post(
    session: aiohttp.ClientSession, url: str, request: dict[str, Any]
) -> dict[str, Any]:
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}
    async with session.post(url, json=body) as response:
        assert response.status == 200
        result: dict[str, Any] = (await response.json())["response"]
        return result


def _status(fake: FakeApiServer, name: str = "team-a") -> dict[str, Any]:
    obj = fake.get("gpuquotas", name, "team-a")
    assert obj is not None
    status: dict[str, Any] = obj.get("status") or {}
    return status


async def _eventually(check: Callable[[], bool], within_s: float = 5.0) -> None:
    """Poll a condition on state that other tasks change (cache, fake, metrics)."""
    async with asyncio.timeout(within_s):
        while not check():  # noqa: ASYNC110 - the state has no event to wait on
            await asyncio.sleep(0.02)


async def _synced_controller(
    stack: AsyncExitStack, fake: FakeApiServer, **kwargs: Any
) -> UsageController:
    service = await _service(stack, fake)
    controller = service.controller()
    for key, value in kwargs.items():
        setattr(controller, key, value)
    controller.pods.start()
    stack.push_async_callback(controller.pods.stop)
    await controller.pods.wait_synced(5)
    return controller


async def _cache_has(controller: UsageController, pods: list[dict[str, Any]]) -> None:
    names = {p["metadata"]["name"] for p in pods}
    await _eventually(
        lambda: names <= {o["metadata"]["name"] for o in controller.pods.objects("team-a")}
    )


async def test_two_replicas_200_concurrent_creates_never_over_admit(fake: FakeApiServer) -> None:
    fake.put(gpu_quota(gpu="4.5", gpumem="64Gi"))
    async with AsyncExitStack() as stack:
        controller = await _synced_controller(stack, fake)
        await controller.reconcile_all()  # counts the new quota, as the running one would
        urls = [await _replica(stack, fake), await _replica(stack, fake)]
        session = await stack.enter_async_context(aiohttp.ClientSession())
        pods = [gpu_pod(f"p{i}", 30, 16) for i in range(200)]
        answers = await asyncio.gather(
            *(_post(session, urls[i % 2], review(pod)) for i, pod in enumerate(pods))
        )
        admitted = [pod for pod, a in zip(pods, answers, strict=True) if a["allowed"]]
        assert len(admitted) == 15  # 15 x 0.30 = 4.50 cards
        denied = [a["status"]["message"] for a in answers if not a["allowed"]]
        assert all(m.startswith('GPU quota exceeded in namespace "team-a"') for m in denied)
        status = _status(fake)
        uids = {p["metadata"]["uid"] for p in admitted}
        # The 8 most recent one by one, the 7 before them in one aggregate.
        assert {entry["uid"] for entry in status["pending"]} <= uids
        assert len(status["pending"]) + status["unmatched"]["pods"] == 15
        assert status["used"]["core"] == 450
        # The pods are persisted; the controller matches the admissions to them.
        for pod in admitted:
            fake.put(pod)
        await _cache_has(controller, admitted)
        await controller.reconcile_all()
        status = _status(fake)
        assert status["used"]["core"] == 450
        assert status["used"]["cards"] == "4.50"
        assert status["pending"] == []
        assert "unmatched" not in status
        # Still full: the next pod is denied with the counted usage.
        answer = await _post(session, urls[0], review(gpu_pod("late", 30, 16)))
        assert not answer["allowed"]
        assert "allows 4.50 cards (4.50 used)" in answer["status"]["message"]


async def test_conflict_storm(fake: FakeApiServer) -> None:
    fake.put(counted_quota(gpu=4))
    async with AsyncExitStack() as stack:
        service = await _service(stack, fake, max_attempts=8)
        fake.fail_writes("gpuquotas", "team-a", "team-a", times=5)
        response = await service.reviewer(_request(gpu_pod("a", 50, 4)))
        assert response.allowed
        assert service.metrics.conflicts.labels("admission")._value.get() == 5
        fake.fail_writes("gpuquotas", "team-a", "team-a", times=50)
        response = await service.reviewer(_request(gpu_pod("b", 50, 4)))
        assert not response.allowed
        assert response.status is not None
        assert 'GPU quota could not be verified in namespace "team-a"' in response.status.message
        assert "changed 8 times" in response.status.message
        assert len(_status(fake)["pending"]) == 1  # only pod "a" was admitted


def _request(pod: dict[str, Any], **kwargs: Any) -> Any:
    from core.admission import AdmissionRequest

    return AdmissionRequest.model_validate(review(pod, **kwargs))


async def test_dry_run_reserves_nothing(fake: FakeApiServer) -> None:
    fake.put(counted_quota(gpu=1))
    async with AsyncExitStack() as stack:
        service = await _service(stack, fake)
        version = fake.get("gpuquotas", "team-a", "team-a")["metadata"]["resourceVersion"]
        assert (await service.reviewer(_request(gpu_pod("a", 100, 4), dry_run=True))).allowed
        denied = await service.reviewer(_request(gpu_pod("b", 200, 4), dry_run=True))
        assert not denied.allowed
        after = fake.get("gpuquotas", "team-a", "team-a")
        assert after is not None
        assert after["metadata"]["resourceVersion"] == version
        assert "pending" not in after["status"]


@pytest.mark.parametrize("mode", ["503", "drop", "slow"])
async def test_api_server_down_or_slow(fake: FakeApiServer, mode: str) -> None:
    fake.put(counted_quota(gpu=4))
    async with AsyncExitStack() as stack:
        service = await _service(
            stack, fake, timeout_s=0.5, request_timeout_s=0.3, count_wait_s=0.1
        )
        if mode == "slow":
            fake.latency = 2.0
        else:
            fake.down(mode)
        gpu = await service.reviewer(_request(gpu_pod("a", 50, 4)))
        assert not gpu.allowed
        assert gpu.status is not None
        message = gpu.status.message
        assert message.startswith('GPU quota could not be verified in namespace "team-a": ')
        assert "GPU pods are never admitted unaccounted" in message
        assert (await service.reviewer(_request(plain_pod("cpu")))).allowed
        fake.latency = 0.0
        fake.up()


async def test_restart_recomputes_identical_usage_and_terminal_pods_release(
    fake: FakeApiServer,
) -> None:
    fake.put(gpu_quota(gpu=8, gpumem="64Gi", pods=10))
    pods = [gpu_pod(f"p{i}", 50, 8) for i in range(4)]
    done = gpu_pod("done", 100, 4)
    done["status"] = {"phase": "Succeeded"}
    for pod in [*pods, done, plain_pod("cpu")]:
        fake.put(pod)
    async with AsyncExitStack() as stack:
        first = await _synced_controller(stack, fake)
        await first.reconcile_all()
        used = _status(fake)["used"]
        assert (used["core"], used["memoryMiB"], used["pods"]) == (200, 4 * 8 * 256, 4)
        # A fresh controller (restart) on a quota whose status was lost counts the same.
        fake.put(gpu_quota(gpu=8, gpumem="64Gi", pods=10))
        second = await _synced_controller(stack, fake)
        await second.reconcile_all()
        assert _status(fake)["used"] == used
        # A pod that finishes, and one that is deleted, release their share.
        finished = dict(pods[0], status={"phase": "Failed"})
        fake.put(finished)
        fake.remove("pods", "p1", "team-a")
        await _eventually(lambda: len(second.pods.objects("team-a")) == 5)
        await _eventually(lambda: second.pods.get("p0", "team-a")["status"]["phase"] == "Failed")
        await second.reconcile_all()
        assert _status(fake)["used"]["core"] == 100
        assert _status(fake)["used"]["pods"] == 2


async def test_admissions_of_pods_never_persisted_expire(fake: FakeApiServer) -> None:
    fake.put(counted_quota(gpu=1))
    async with AsyncExitStack() as stack:
        service = await _service(stack, fake, reservation_grace_s=0.05)
        ghost, real = gpu_pod("ghost", 40, 4), gpu_pod("real", 40, 4)
        for pod in (ghost, real):
            assert (await service.reviewer(_request(pod))).allowed
        fake.put(real)  # persisted, but the controller's cache has not seen it yet
        await asyncio.sleep(0.1)
        unsynced = service.controller()  # informer not started: an empty (lagging) cache
        await unsynced.reconcile_all()
        pending = _status(fake)["pending"]
        # The real pod is never uncounted: its admission stays until the cache shows the pod.
        assert [entry["uid"] for entry in pending] == [real["metadata"]["uid"]]
        assert _status(fake)["used"]["core"] == 40
        assert unsynced.metrics.released.labels("expired")._value.get() == 1
        # Room again for the ghost's share.
        assert (await service.reviewer(_request(gpu_pod("next", 40, 4)))).allowed


async def test_controller_follows_pods_under_leader_election(fake: FakeApiServer) -> None:
    fake.put(gpu_quota(gpu=4))
    election = {
        "lease_duration_s": 1.0,
        "renew_interval_s": 0.2,
        "lease_namespace": "fracgpu-system",
    }
    async with AsyncExitStack() as stack:
        a = await _service(stack, fake, leader_election={**election, "identity": "a"})
        b = await _service(stack, fake, leader_election={**election, "identity": "b"})
        runs = [asyncio.create_task(s.run()) for s in (a, b)]
        try:
            await _eventually(
                lambda: a.metrics.leader._value.get() + b.metrics.leader._value.get() == 1
            )
            fake.put(gpu_pod("p", 70, 4))
            await _eventually(lambda: _status(fake).get("used", {}).get("core") == 70)
            leader = fake.get("leases", "fracgpu-quota-controller", "fracgpu-system")
            assert leader is not None
            holder = leader["spec"]["holderIdentity"]
            # The leader goes away; the other replica takes over within the lease duration.
            index = 0 if holder == "a" else 1
            runs[index].cancel()
            await asyncio.gather(runs[index], return_exceptions=True)
            other = (a, b)[1 - index]
            await _eventually(lambda: other.metrics.leader._value.get() == 1, within_s=5)
            fake.put(gpu_pod("q", 30, 4))
            await _eventually(lambda: _status(fake).get("used", {}).get("core") == 100)
        finally:
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)


def _leading(running: list[str], name: str) -> Callable[[], Awaitable[None]]:
    """The leader's work: it notes in ``running`` that it runs, until stopped."""

    async def body() -> None:
        running.append(name)
        try:
            await asyncio.Event().wait()
        finally:
            running.remove(name)

    return body


async def test_leader_election_exclusive(fake: FakeApiServer) -> None:
    async with fake.api_client() as api:
        config = LeaderElection(
            lease_duration_s=1.0, renew_interval_s=0.2, lease_namespace="fracgpu-system"
        )
        running: list[str] = []

        work = partial(_leading, running)
        electors = [
            LeaderElector(api, config.model_copy(update={"identity": n})) for n in ("x", "y", "z")
        ]
        tasks = [asyncio.create_task(e.run(work(e.identity))) for e in electors]
        try:
            await _eventually(lambda: len(running) == 1)
            await asyncio.sleep(1.5)  # several renewals: still exactly one
            assert len(running) == 1
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_jobs_of_one_replica_run_on_the_quota_leader_only(fake: FakeApiServer) -> None:
    """What ``serve`` hands ``run`` (the waiting pods' Events) runs where the controller runs:
    with two replicas, once, not once per replica; and on the other when the leader goes."""
    election: dict[str, Any] = {
        "lease_duration_s": 1.0,
        "renew_interval_s": 0.2,
        "lease_namespace": "fracgpu-system",
    }
    running: list[str] = []
    async with AsyncExitStack() as stack:
        services = {
            name: await _service(stack, fake, leader_election={**election, "identity": name})
            for name in ("a", "b")
        }
        runs = {n: asyncio.create_task(s.run([_leading(running, n)])) for n, s in services.items()}
        try:
            await _eventually(lambda: len(running) == 1)
            await asyncio.sleep(0.6)  # several renewals: still one
            assert len(running) == 1
            leader = running[0]
            runs[leader].cancel()
            await asyncio.gather(runs[leader], return_exceptions=True)
            await _eventually(lambda: running == [{"a": "b", "b": "a"}[leader]], within_s=5)
        finally:
            for run in runs.values():
                run.cancel()
            await asyncio.gather(*runs.values(), return_exceptions=True)


async def test_the_controller_the_explainer_and_the_cache_share_one_watch_per_kind(
    fake: FakeApiServer,
) -> None:
    fake.put(gpu_quota(gpu=4))
    async with AsyncExitStack() as stack:
        api = await stack.enter_async_context(fake.api_client())
        informers = Informers(api)
        config = QuotaConfig(leader_election={"enabled": False})
        service = await open_quota(config, api, informers=informers)
        stack.push_async_callback(service.close)
        explainer = WaitExplainer(api, device_plugin=True, informers=informers)
        run = asyncio.create_task(service.run([explainer.run]))
        try:
            fake.put(gpu_pod("p", 70, 4))
            await _eventually(lambda: _status(fake).get("used", {}).get("core") == 70)
            kinds = sorted(w.kind.plural for w in fake.store.watchers)
            assert kinds == ["gpuquotas", "nodes", "pods"]
        finally:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)


async def test_reread_after_conflict_uses_a_newer_cached_object_else_reads_live(
    fake: FakeApiServer,
) -> None:
    """After a 409 the winner's write is usually in the watch cache already: the retry then
    reads nothing; a cache no newer than the object that conflicted is never used."""
    from quota.kubestore import KubeQuotaStore

    fake.put(counted_quota(gpu=4))
    async with AsyncExitStack() as stack:
        api = await stack.enter_async_context(fake.api_client())
        store = KubeQuotaStore(api, watch=True)
        store.start()
        stack.push_async_callback(store.stop)
        stale = await store.get("team-a", "team-a")
        winner = fake.put({**stale, "status": {**(stale.get("status") or {}), "x": 1}})
        version = winner["metadata"]["resourceVersion"]
        await _eventually(
            lambda: (
                any(o["metadata"]["resourceVersion"] == version for o in store._informer.objects())
                if store._informer is not None and store._informer.has_synced
                else False
            )
        )
        gets = len([r for r in fake.requests if r.method == "GET" and "team-a/gpuquotas" in r.path])
        obj, live = await store.reread("team-a", "team-a", stale["metadata"]["resourceVersion"])
        assert (obj["metadata"]["resourceVersion"], live) == (version, False)
        after = len(
            [r for r in fake.requests if r.method == "GET" and "team-a/gpuquotas" in r.path]
        )
        assert after == gets  # no read

        # Nothing newer cached than what conflicted: read live.
        obj, live = await store.reread("team-a", "team-a", version)
        assert (obj["metadata"]["resourceVersion"], live) == (version, True)


async def test_a_stopping_leader_releases_the_lease_at_once(fake: FakeApiServer) -> None:
    """A rolling update: the leader stops, and the other replica leads at its next try, not a
    lease duration (here 10 s) later; the controller's work never runs on both."""
    async with fake.api_client() as api:
        config = LeaderElection(
            lease_duration_s=10.0, renew_interval_s=0.1, lease_namespace="fracgpu-system"
        )
        running: list[str] = []

        work = partial(_leading, running)
        first = LeaderElector(api, config.model_copy(update={"identity": "old"}))
        old = asyncio.create_task(first.run(work("old")))
        await _eventually(lambda: running == ["old"])
        second = LeaderElector(api, config.model_copy(update={"identity": "new"}))
        new = asyncio.create_task(second.run(work("new")))
        try:
            await asyncio.sleep(0.5)
            assert running == ["old"]  # a live leader is not displaced
            old.cancel()
            await asyncio.gather(old, return_exceptions=True)
            stopped = time.monotonic()
            await _eventually(lambda: running == ["new"])
            assert time.monotonic() - stopped < 2.0
            lease = fake.get("leases", config.lease_name, "fracgpu-system") or {}
            assert lease["spec"]["holderIdentity"] == "new"
        finally:
            new.cancel()
            await asyncio.gather(new, return_exceptions=True)
