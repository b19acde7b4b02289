"""The admission server over real HTTPS, fed what kube-apiserver sends.

The client verifies the server certificate against the CA the project issued, as the apiserver
does with the caBundle; every reply is checked the way ``VerifyAdmissionResponse`` checks it,
and every patch is applied to the object that was sent.
"""

from __future__ import annotations

import base64
import copy
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import jsonpatch
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from certs.config import CertsConfig
from certs.serving import open_serving
from core.admission import AdmissionRequest, AdmissionResponse
from webhook.config import AdmissionConfig
from webhook.inventory import Inventory
from webhook.metrics import AdmissionMetrics
from webhook.mutation import Mutator
from webhook.server import build_app

EXAMPLE = json.loads(
    (Path(__file__).parent.parent / "examples" / "admissionreview-pod.json").read_text()
)


@dataclass
class Server:
    url: str
    session: aiohttp.ClientSession
    metrics: AdmissionMetrics

    async def post(
        self, path: str, body: Any, *, raw: bytes | None = None
    ) -> aiohttp.ClientResponse:
        data = raw if raw is not None else json.dumps(body).encode()
        resp = await self.session.post(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        await resp.read()
        return resp

    async def review(self, body: dict[str, Any], path: str = "/mutate") -> dict[str, Any]:
        resp = await self.post(path, body)
        assert resp.status == 200
        reply = await resp.json()
        # What kube-apiserver verifies before it trusts a reply (design K1).
        assert reply["apiVersion"] == body["apiVersion"]
        assert reply["kind"] == "AdmissionReview"
        response: dict[str, Any] = reply["response"]
        assert response["uid"] == body["request"]["uid"]
        assert ("patch" in response) == ("patchType" in response)
        if "patchType" in response:
            assert response["patchType"] == "JSONPatch"
        return response


async def boom(req: AdmissionRequest) -> AdmissionResponse:
    raise RuntimeError("reviewer bug")


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    certs = await open_serving(CertsConfig(mode="directory", directory=tmp_path), standalone=True)
    metrics = AdmissionMetrics()
    mutator = Mutator(AdmissionConfig(), Inventory({"NVIDIA-H100-80GB-HBM3": 81559}))
    app = build_app({"/mutate": mutator, "/boom": boom}, metrics=metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=certs.context)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client_ctx = ssl.create_default_context(cadata=certs.ca_bundle_pem().decode())
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=client_ctx))
    try:
        yield Server(f"https://127.0.0.1:{port}", session, metrics)
    finally:
        await session.close()
        await runner.cleanup()


def patched(body: dict[str, Any], response: dict[str, Any], key: str = "object") -> Any:
    ops = json.loads(base64.b64decode(response["patch"]))
    return jsonpatch.apply_patch(body["request"][key], ops)


async def test_kubectl_pod_create(server: Server) -> None:
    response = await server.review(EXAMPLE)
    assert response["allowed"] is True
    pod = patched(EXAMPLE, response)
    container = pod["spec"]["containers"][0]
    assert container["resources"] == {
        "limits": {"fracgpu.io/core": "30", "fracgpu.io/memory": "32"},
        "requests": {"fracgpu.io/core": "30", "fracgpu.io/memory": "32"},
    }
    # admission.scheduler_name is empty by default: the pod keeps the scheduler it names.
    assert pod["spec"]["schedulerName"] == "default-scheduler"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"][
        "tolerations"
    ]
    # The reply is idempotent under reinvocation.
    again = copy.deepcopy(EXAMPLE)
    again["request"]["object"] = pod
    assert "patch" not in await server.review(again)


async def test_pod_from_replicaset_has_no_name_or_namespace(server: Server) -> None:
    body = copy.deepcopy(EXAMPLE)
    req = body["request"]
    req["name"] = ""
    req["userInfo"] = {"username": "system:serviceaccount:kube-system:replicaset-controller"}
    meta = req["object"]["metadata"]
    meta.pop("name")
    meta.pop("namespace")
    meta["generateName"] = "inference-7d9f8-"
    meta["ownerReferences"] = [
        {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "name": "inference-7d9f8",
            "uid": "x",
            "controller": True,
        }
    ]
    response = await server.review(body)
    pod = patched(body, response)
    assert pod["metadata"]["generateName"] == "inference-7d9f8-"
    assert "fracgpu.io/request" in pod["metadata"]["annotations"]


def deployment_review(operation: str) -> dict[str, Any]:
    template = copy.deepcopy(EXAMPLE["request"]["object"])
    template["metadata"] = {"labels": {"app": "inference"}}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "inference", "namespace": "team-a"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "inference"}},
            "template": template,
        },
    }
    body = copy.deepcopy(EXAMPLE)
    body["request"].update(
        kind={"group": "apps", "version": "v1", "kind": "Deployment"},
        resource={"group": "apps", "version": "v1", "resource": "deployments"},
        name="inference",
        operation=operation,
        object=deployment,
        oldObject=copy.deepcopy(deployment) if operation == "UPDATE" else None,
    )
    return body


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE"])
async def test_deployment(server: Server, operation: str) -> None:
    body = deployment_review(operation)
    response = await server.review(body)
    deployment = patched(body, response)
    limits = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"fracgpu.io/core": "30", "fracgpu.io/memory": "32"}


async def test_dry_run_gets_the_same_answer(server: Server) -> None:
    body = copy.deepcopy(EXAMPLE)
    body["request"]["dryRun"] = True
    assert (await server.review(body))["patch"] == (await server.review(EXAMPLE))["patch"]


async def test_v1beta1_is_answered_in_v1beta1(server: Server) -> None:
    body = copy.deepcopy(EXAMPLE)
    body["apiVersion"] = "admission.k8s.io/v1beta1"
    response = await server.review(body)
    assert response["allowed"] is True and "patch" in response


async def test_denial_message_and_status(server: Server) -> None:
    body = copy.deepcopy(EXAMPLE)
    resources = body["request"]["object"]["spec"]["containers"][0]["resources"]
    resources["limits"] = resources["requests"] = {"fracgpu.io/gpu": "1500m"}
    response = await server.review(body)
    assert response["allowed"] is False
    assert response["status"] == {
        "status": "Failure",
        "reason": "Invalid",
        "code": 422,
        "message": 'container "jupyter": fracgpu.io/gpu must be a fraction between 0.01 and 1 '
        "with at most two decimals, or a whole number of cards; got 1.5",
    }
    assert "patch" not in response


async def test_internal_error_fails_closed_with_http_200(server: Server) -> None:
    response = await server.review(EXAMPLE, path="/boom")
    assert response["allowed"] is False
    assert response["status"]["reason"] == "InternalError"
    assert EXAMPLE["request"]["uid"] in response["status"]["message"]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"", "not an AdmissionReview"),
        (b"not json", "not an AdmissionReview"),
        (b"[]", "not an AdmissionReview"),
        (
            b'{"apiVersion":"admission.k8s.io/v2","kind":"AdmissionReview"}',
            "unsupported apiVersion",
        ),
        (b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}', "request is missing"),
        (
            b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":""}}',
            "request.uid",
        ),
    ],
)
async def test_malformed_bodies_get_400(server: Server, raw: bytes, expected: str) -> None:
    resp = await server.post("/mutate", None, raw=raw)
    assert resp.status == 400
    assert expected in (await resp.json())["error"]


async def test_large_pods_fit_and_oversized_bodies_are_refused(server: Server) -> None:
    body = copy.deepcopy(EXAMPLE)
    container = body["request"]["object"]["spec"]["containers"][0]
    container["env"] = [{"name": f"VAR_{i}", "value": "x" * 1000} for i in range(3500)]
    assert len(json.dumps(body)) > 3 * 2**20
    assert (await server.review(body))["allowed"] is True
    resp = await server.post("/mutate", None, raw=b" " * (9 * 2**20))
    assert resp.status == 413


async def test_health_readiness_and_metrics(server: Server) -> None:
    await server.review(EXAMPLE)
    for path in ("/healthz", "/readyz"):
        async with server.session.get(server.url + path) as resp:
            assert resp.status == 200
    async with server.session.get(server.url + "/metrics") as resp:
        text = await resp.text()
    assert (
        'fracgpu_admission_reviews_total{endpoint="/mutate",outcome="allowed",reason="gpu"} 1.0'
        in text
    )
    assert "fracgpu_admission_duration_seconds_bucket" in text


async def test_plain_http_is_refused(server: Server) -> None:
    plain = server.url.replace("https://", "http://")
    with pytest.raises(aiohttp.ClientError):
        async with aiohttp.ClientSession() as s, s.get(plain + "/healthz") as resp:
            await resp.read()


fuzz_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=10), c, max_size=3),
    max_leaves=12,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    mutation=st.lists(
        st.tuples(
            st.sampled_from(
                [
                    "apiVersion",
                    "kind",
                    "request",
                    "uid",
                    "operation",
                    "object",
                    "dryRun",
                    "spec",
                    "metadata",
                    "containers",
                ]
            ),
            fuzz_values,
        ),
        max_size=4,
    ),
    junk=st.binary(max_size=64),
)
async def test_fuzzed_bodies_never_get_a_500(
    server: Server, mutation: list[tuple[str, Any]], junk: bytes
) -> None:
    body = copy.deepcopy(EXAMPLE)
    targets = [body, body["request"], body["request"]["object"], body["request"]["object"]["spec"]]
    for i, (key, value) in enumerate(mutation):
        targets[i % len(targets)][key] = value
    for raw in (json.dumps(body).encode(), junk):
        resp = await server.post("/mutate", None, raw=raw)
        assert resp.status in (200, 400), resp.status
