"""Quota decisions forwarded to the controller's leader (quota.forward): one writer per
GPUQuota under load, and a replica that decides itself whenever the leader is out of reach."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from certs.config import CertsConfig
from certs.serving import open_serving
from quota.config import QuotaConfig
from quota.demand import Demand
from quota.forward import DECIDE_PATH, MAX_BODY_BYTES, Forwarder, decode, encode
from quota.metrics import QuotaMetrics
from quota.service import QuotaService, open_quota
from testkit.apiserver import FakeApiServer
from testkit.quota_pods import counted_quota, gpu_pod, review
from webhook.server import build_app
from webhook.transport import listen

ELECTION = {"lease_duration_s": 2.0, "renew_interval_s": 0.1, "lease_namespace": "team-a"}


@pytest.fixture
async def fake() -> AsyncIterator[FakeApiServer]:
    async with FakeApiServer(namespaces=("team-a",)) as server:
        yield server


def _free_address() -> tuple[socket.socket, str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


async def _replica(
    stack: AsyncExitStack, fake: FakeApiServer, name: str, **config: Any
) -> tuple[QuotaService, str]:
    """A replica serving /validate and the decision endpoint over HTTP, electing a leader."""
    sock, address = _free_address()
    api = await stack.enter_async_context(fake.api_client())
    quota = QuotaConfig(
        leader_election={**ELECTION, "identity": name}, advertise_url=address, **config
    )
    service = await open_quota(quota, api)
    stack.push_async_callback(service.close)
    app = build_app(
        {"/validate": service.reviewer}, handlers={DECIDE_PATH: service.decide_endpoint}
    )
    runner = web.AppRunner(app)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    stack.push_async_callback(runner.cleanup)
    task = asyncio.create_task(service.run())
    stack.callback(task.cancel)
    return service, f"{address}/validate"


async def _eventually(check: Callable[[], bool], within_s: float = 5.0) -> None:
    async with asyncio.timeout(within_s):
        while not check():  # noqa: ASYNC110 - the state has no event to wait on
            await asyncio.sleep(0.02)


async def _post(session: aiohttp.ClientSession, url: str, pod: dict[str, Any]) -> bool:
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": review(pod)}
    async with session.post(url, json=body) as reply:
        allowed: bool = (await reply.json())["response"]["allowed"]
        return allowed


def _count(counter: Any) -> float:
    value: float = counter._value.get()
    return value


# --- the wire format ---------------------------------------------------------------------


def test_encode_decode_round_trip() -> None:
    demand = Demand(30, 8192, frozenset({"NVIDIA-H100"}), unsized_cards=1)
    namespace, uid, pod, decoded = decode(encode("team-a", "u1", "train-0", demand))
    assert (namespace, uid, pod) == ("team-a", "u1", "train-0")
    assert decoded == demand
    assert decode(encode("n", "u", "p", Demand(100, 0)))[3] == Demand(100, 0)


def test_an_excluded_model_is_forwarded() -> None:
    demand = Demand(30, 8192, excluded=frozenset({"NVIDIA-L4"}))
    assert decode(encode("n", "u", "p", demand))[3] == demand


def test_a_replica_of_an_earlier_version_forwards_no_exclusion() -> None:
    wire: dict[str, object] = dict(encode("n", "u", "p", Demand(30, 8192)))
    wire["demand"] = {
        k: v
        for k, v in encode("n", "u", "p", Demand(30, 8192))["demand"].items()
        if k != "excludedModels"
    }
    assert decode(wire)[3] == Demand(30, 8192)


@pytest.mark.parametrize(
    ("body", "error"),
    [
        pytest.param([], "the body must be a JSON object", id="not-an-object"),
        pytest.param({"uid": "u", "pod": "p"}, "'namespace' must be", id="no-namespace"),
        pytest.param({"namespace": "n", "uid": "", "pod": "p"}, "'uid' must be", id="empty-uid"),
        pytest.param({"namespace": "n", "uid": "u", "pod": "p"}, "'demand' must", id="no-demand"),
        pytest.param(
            {"namespace": "n", "uid": "u", "pod": "p", "demand": {"core": -1}},
            "'demand.core' must be a non-negative integer",
            id="negative-core",
        ),
        pytest.param(
            {
                "namespace": "n",
                "uid": "u",
                "pod": "p",
                "demand": {"core": True, "memoryMiB": 0, "unsizedCards": 0},
            },
            "'demand.core' must be a non-negative integer",
            id="boolean-core",
        ),
        pytest.param(
            {
                "namespace": "n",
                "uid": "u",
                "pod": "p",
                "demand": {"core": 1, "memoryMiB": 0, "unsizedCards": 0, "models": "H100"},
            },
            "'demand.models' must be null or a list of strings",
            id="models-not-a-list",
        ),
        pytest.param(
            {
                "namespace": "n",
                "uid": "u",
                "pod": "p",
                "demand": {"core": 1, "memoryMiB": 0, "unsizedCards": 0, "excludedModels": 1},
            },
            "'demand.excludedModels' must be a list of strings",
            id="excluded-models-not-a-list",
        ),
    ],
)
def test_decode_refuses_malformed_requests(body: object, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        decode(body)


async def test_decide_endpoint_refuses_bad_bodies(fake: FakeApiServer) -> None:
    fake.put(counted_quota(gpu=1))
    async with AsyncExitStack() as stack:
        _, url = await _replica(stack, fake, "a")
        decide = url.replace("/validate", DECIDE_PATH)
        session = await stack.enter_async_context(aiohttp.ClientSession())
        async with session.post(decide, json={"namespace": "team-a"}) as reply:
            assert reply.status == 400
            assert "bad decision request: 'uid' must be" in (await reply.json())["error"]
        async with session.post(decide, data=b"x" * (MAX_BODY_BYTES + 1)) as reply:
            assert reply.status == 413


# --- two replicas, one writer ------------------------------------------------------------


async def test_the_other_replica_forwards_and_one_writer_admits_exactly_what_fits(
    fake: FakeApiServer,
) -> None:
    fake.put(counted_quota(gpu="3"))
    async with AsyncExitStack() as stack:
        a, url_a = await _replica(stack, fake, "a")
        b, url_b = await _replica(stack, fake, "b")
        services = {"a": (a, url_a), "b": (b, url_b)}
        await _eventually(lambda: any(s.elector and s.elector.is_leader for s in (a, b)))
        leader_name = next(n for n, (s, _) in services.items() if s.elector and s.elector.is_leader)
        leader, _ = services[leader_name]
        other, other_url = services["b" if leader_name == "a" else "a"]
        assert other.elector is not None
        await _eventually(
            lambda: other.elector is not None and other.elector.leader_url() is not None
        )
        local: list[str] = []
        decide_here = other.reserver.decide

        async def spy(namespace: str, uid: str, *args: Any, **kwargs: Any) -> Any:
            local.append(uid)
            return await decide_here(namespace, uid, *args, **kwargs)

        other.reserver.decide = spy  # type: ignore[method-assign]
        session = await stack.enter_async_context(aiohttp.ClientSession())
        pods = [gpu_pod(f"p{i}", 20, 4) for i in range(40)]
        answers = await asyncio.gather(*(_post(session, other_url, pod) for pod in pods))
        assert sum(answers) == 15  # 15 x 0.20 = 3 cards
        assert _count(other.metrics.forwarded.labels("answered")) == 40
        assert _count(leader.metrics.decided_for_peers) == 40
        # The other replica decided nothing itself: every admission write was the leader's.
        assert local == []
        status = (fake.get("gpuquotas", "team-a", "team-a") or {})["status"]
        assert status["used"]["core"] == 300


async def test_a_replica_decides_itself_when_the_leader_is_out_of_reach(
    fake: FakeApiServer,
) -> None:
    fake.put(counted_quota(gpu="1"))
    closed, dead = _free_address()
    closed.close()  # nothing listens there: connection refused
    async with AsyncExitStack() as stack:
        api = await stack.enter_async_context(fake.api_client())
        service = await open_quota(QuotaConfig(leader_election=ELECTION), api)
        stack.push_async_callback(service.close)
        assert service.forwarder is not None
        service.forwarder.leader = lambda: dead
        first = await service.reviewer(_request(gpu_pod("a", 50, 4)))
        second = await service.reviewer(_request(gpu_pod("b", 50, 4)))
        third = await service.reviewer(_request(gpu_pod("c", 50, 4)))
        assert (first.allowed, second.allowed, third.allowed) == (True, True, False)
        # One failed try, then it decides itself for a while instead of trying per pod.
        assert _count(service.metrics.forwarded.labels("fallback")) == 1
        assert _count(service.metrics.forwarded.labels("answered")) == 0


async def test_a_leader_that_does_not_answer_leaves_the_decision_within_its_timeout(
    fake: FakeApiServer,
) -> None:
    """The leader accepted the request and hangs: after half of quota.timeout_s the replica
    decides itself with what is left, so the whole decision stays within timeout_s."""
    fake.put(counted_quota(gpu="1"))
    release = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({})

    sock, address = _free_address()
    runner = web.AppRunner(build_app({}, handlers={DECIDE_PATH: hang}))
    await runner.setup()
    await web.SockSite(runner, sock).start()
    async with AsyncExitStack() as stack:
        stack.push_async_callback(runner.cleanup)
        stack.callback(release.set)
        api = await stack.enter_async_context(fake.api_client())
        config = QuotaConfig(
            leader_election=ELECTION, timeout_s=1.0, request_timeout_s=1.0, count_wait_s=0.2
        )
        service = await open_quota(config, api)
        stack.push_async_callback(service.close)
        assert service.forwarder is not None
        service.forwarder.leader = lambda: address
        fake.latency = 10.0  # and the API server is slow too: deciding here runs out of time
        started = asyncio.get_running_loop().time()
        answer = await service.reviewer(_request(gpu_pod("a", 50, 4)))
        elapsed = asyncio.get_running_loop().time() - started
        fake.latency = 0.0
        assert not answer.allowed
        assert answer.status is not None
        assert "could not be verified" in answer.status.message
        assert 0.9 <= elapsed < 1.3  # half waiting for the leader, half deciding here
        assert _count(service.metrics.forwarded.labels("fallback")) == 1


async def test_a_dry_run_is_never_forwarded(fake: FakeApiServer) -> None:
    fake.put(counted_quota(gpu="1"))
    async with AsyncExitStack() as stack:
        api = await stack.enter_async_context(fake.api_client())
        service = await open_quota(QuotaConfig(leader_election=ELECTION), api)
        stack.push_async_callback(service.close)
        assert service.forwarder is not None
        asked: list[str] = []

        def leader() -> str:
            asked.append("yes")
            return "http://127.0.0.1:9"

        service.forwarder.leader = leader
        answer = await service.reviewer(_request(gpu_pod("a", 50, 4), dry_run=True))
        assert answer.allowed
        assert asked == []


def _request(pod: dict[str, Any], **kwargs: Any) -> Any:
    from core.admission import AdmissionRequest

    return AdmissionRequest.model_validate(review(pod, **kwargs))


# --- over TLS, as between pods -----------------------------------------------------------


@pytest.mark.parametrize(
    ("trusted", "answered"),
    [
        pytest.param(True, 1, id="leader-certificate-verified"),
        pytest.param(False, 0, id="unknown-ca-refused"),
    ],
)
async def test_forwarding_checks_the_leaders_certificate(
    tmp_path: Path, trusted: bool, answered: int
) -> None:
    """The leader is reached by pod address and checked against the Service name that every
    replica's serving certificate carries; a certificate from another CA is not trusted."""
    config = CertsConfig(mode="directory", directory=tmp_path / "certs", inject=False)
    certs = await open_serving(config, standalone=False)
    other = await open_serving(
        CertsConfig(mode="directory", directory=tmp_path / "other", inject=False), standalone=False
    )

    async def decide(request: web.Request) -> web.Response:
        return web.json_response({"allowed": True, "message": "", "reason": "fits"})

    app = build_app({}, handlers={DECIDE_PATH: decide})
    listener = await listen(app, "127.0.0.1", 0, certs.context)
    metrics = QuotaMetrics(CollectorRegistry())
    forwarder = Forwarder(
        lambda: f"https://127.0.0.1:{listener.port}",
        metrics,
        timeout_s=2,
        ca_pem=(certs if trusted else other).ca_bundle_pem,
        server_name=config.service_dns_names()[2],
    )
    try:
        decision = await forwarder.decide("team-a", "u", "p", Demand(10, 256))
        assert (decision is not None) == trusted
        assert _count(metrics.forwarded.labels("answered")) == answered
    finally:
        await forwarder.close()
        await listener.close()
        await certs.close()
        await other.close()


@pytest.mark.parametrize(
    ("configured", "pod_ip", "expected"),
    [
        pytest.param(None, "10.1.2.3", "https://10.1.2.3:8443", id="from-pod-ip"),
        pytest.param(None, "fd00::7", "https://[fd00::7]:8443", id="ipv6-pod-ip"),
        pytest.param(None, "", None, id="no-pod-ip-advertises-nothing"),
        pytest.param("https://peer:9443", "10.1.2.3", "https://peer:9443", id="configured-wins"),
    ],
)
def test_serve_advertises_the_pod_address(
    monkeypatch: pytest.MonkeyPatch, configured: str | None, pod_ip: str, expected: str | None
) -> None:
    from fracgpu.serve import _with_advertise

    monkeypatch.setenv("POD_IP", pod_ip)
    quota = _with_advertise(QuotaConfig(advertise_url=configured), 8443)
    assert quota.advertise_url == expected
