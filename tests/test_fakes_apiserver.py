"""The fake API server's semantics, proved with the real kubernetes-asyncio client.

Every test talks HTTP through the client's typed APIs (CoreV1Api, CustomObjectsApi,
CoordinationV1Api, AdmissionregistrationV1Api) or `watch.Watch`, configured from the kubeconfig the
fake writes, so a departure from what the client expects of kube-apiserver fails here first.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from testkit.apiserver import FakeApiServer

NS = "default"


@pytest.fixture
def core(api: Any) -> Any:
    return client.CoreV1Api(api)


@pytest.fixture
def custom(api: Any) -> Any:
    return client.CustomObjectsApi(api)


def pod(name: str = "", labels: dict[str, str] | None = None, generate: str = "") -> Any:
    return client.V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=client.V1ObjectMeta(
            name=name or None, generate_name=generate or None, labels=labels
        ),
        spec=client.V1PodSpec(containers=[client.V1Container(name="main", image="busybox")]),
    )


def secret(name: str, labels: dict[str, str] | None = None) -> Any:
    return client.V1Secret(
        metadata=client.V1ObjectMeta(name=name, labels=labels), string_data={"k": "v"}
    )


def quota(name: str, gpu: str = "4", status: dict[str, Any] | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "fracgpu.io/v1",
        "kind": "GPUQuota",
        "metadata": {"name": name},
        "spec": {"gpu": gpu},
    }
    if status is not None:
        obj["status"] = status
    return obj


def status_of(err: ApiException) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(err.body)
    assert body["kind"] == "Status"
    assert body["apiVersion"] == "v1"
    assert body["status"] == "Failure"
    assert body["code"] == err.status
    return body


GQ = ("fracgpu.io", "v1", NS, "gpuquotas")


async def bind(core: Any, name: str, node: str) -> int:
    """POST pods/binding, as the scheduler does. The real server answers with a `Status`, which
    kubernetes-asyncio fails to deserialize as a V1Binding (a known client bug, reproduced by the
    fake), so the raw response is read instead."""
    binding = client.V1Binding(
        metadata=client.V1ObjectMeta(name=name),
        target=client.V1ObjectReference(kind="Node", name=node),
    )
    response = await core.create_namespaced_pod_binding(name, NS, binding, _preload_content=False)
    response.release()
    status: int = response.status
    return status


# --- configuration and errors --------------------------------------------------------------


async def test_kubeconfig_loads_and_other_tokens_are_refused(
    fake: FakeApiServer, tmp_path: Path
) -> None:
    path = fake.kubeconfig(tmp_path / "kc")
    assert path.stat().st_mode & 0o777 == 0o600
    configuration = client.Configuration()
    await config.load_kube_config(config_file=str(path), client_configuration=configuration)
    assert configuration.host == fake.url
    anonymous = client.ApiClient(client.Configuration(host=fake.url))
    async with anonymous:
        with pytest.raises(ApiException) as err:
            await client.CoreV1Api(anonymous).list_namespace()
    assert err.value.status == 401
    assert status_of(err.value)["reason"] == "Unauthorized"


async def test_get_missing_is_a_404_status_naming_the_object(core: Any, custom: Any) -> None:
    with pytest.raises(ApiException) as err:
        await core.read_namespaced_pod("nope", NS)
    body = status_of(err.value)
    assert (err.value.status, body["reason"]) == (404, "NotFound")
    assert body["message"] == 'pods "nope" not found'
    assert body["details"] == {"name": "nope", "kind": "pods"}
    with pytest.raises(ApiException) as err:
        await custom.get_namespaced_custom_object(*GQ, "q")
    assert status_of(err.value)["message"] == 'gpuquotas.fracgpu.io "q" not found'


async def test_create_sets_identity_and_defaults(core: Any, fake: FakeApiServer) -> None:
    made = await core.create_namespaced_pod(NS, pod(generate="train-"))
    assert made.metadata.name.startswith("train-")
    assert len(made.metadata.name) == 11
    assert made.metadata.uid
    assert made.metadata.creation_timestamp
    assert made.metadata.namespace == NS
    assert made.metadata.resource_version == str(fake.resource_version)
    assert made.status.phase == "Pending"
    assert made.spec.scheduler_name == "default-scheduler"
    read = await core.read_namespaced_pod(made.metadata.name, NS)
    assert read.metadata.uid == made.metadata.uid


async def test_create_twice_is_409_already_exists(core: Any) -> None:
    await core.create_namespaced_pod(NS, pod("a"))
    with pytest.raises(ApiException) as err:
        await core.create_namespaced_pod(NS, pod("a"))
    body = status_of(err.value)
    assert (err.value.status, body["reason"]) == (409, "AlreadyExists")
    assert body["message"] == 'pods "a" already exists'


async def test_create_needs_an_existing_namespace(core: Any) -> None:
    with pytest.raises(ApiException) as err:
        await core.create_namespaced_pod("ghost", pod("a"))
    assert err.value.status == 404
    assert status_of(err.value)["message"] == 'namespaces "ghost" not found'
    await core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="ghost")))
    await core.create_namespaced_pod("ghost", pod("a"))


async def test_one_resource_version_counter_across_kinds(core: Any, custom: Any) -> None:
    versions = [
        int((await core.create_namespaced_secret(NS, secret("s"))).metadata.resource_version),
        int((await core.create_namespaced_pod(NS, pod("p"))).metadata.resource_version),
        int(
            (await custom.create_namespaced_custom_object(*GQ, quota("q")))["metadata"][
                "resourceVersion"
            ]
        ),
    ]
    assert versions == sorted(versions)
    assert len(set(versions)) == 3
    listed = await core.list_namespaced_pod(NS)
    assert int(listed.metadata.resource_version) == versions[-1]


# --- list ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("app=web", ["a", "b"]),
        ("app==web", ["a", "b"]),
        ("app!=web", ["c", "d"]),
        ("app in (web,db)", ["a", "b", "c"]),
        ("app notin (web)", ["c", "d"]),
        ("tier", ["a", "c"]),
        ("!tier", ["b", "d"]),
        ("app=web,tier=front", ["a"]),
        ("app in (web, db),!tier", ["b"]),
    ],
)
async def test_label_selectors(core: Any, selector: str, expected: list[str]) -> None:
    labels = {
        "a": {"app": "web", "tier": "front"},
        "b": {"app": "web"},
        "c": {"app": "db", "tier": "back"},
        "d": {},
    }
    for name, lbl in labels.items():
        await core.create_namespaced_secret(NS, secret(name, lbl or None))
    listed = await core.list_namespaced_secret(NS, label_selector=selector)
    assert [s.metadata.name for s in listed.items] == expected


async def test_field_selectors(core: Any, fake: FakeApiServer) -> None:
    for name in ("a", "b", "c"):
        await core.create_namespaced_pod(NS, pod(name))
    assert await bind(core, "a", "n1") == 201
    await core.patch_namespaced_pod_status("b", NS, {"status": {"phase": "Succeeded"}})

    async def names(selector: str) -> list[str]:
        listed = await core.list_pod_for_all_namespaces(field_selector=selector)
        return [p.metadata.name for p in listed.items]

    assert await names("spec.nodeName=n1") == ["a"]
    assert await names("spec.nodeName=") == ["b", "c"]
    assert await names("status.phase!=Succeeded") == ["a", "c"]
    assert await names("metadata.name=c,metadata.namespace=default") == ["c"]
    with pytest.raises(ApiException) as err:
        await names("spec.priority=1")
    assert err.value.status == 400
    assert "field label not supported: spec.priority" in status_of(err.value)["message"]


async def test_list_items_carry_kind_only_for_custom_resources(
    fake: FakeApiServer, core: Any, custom: Any, api: Any
) -> None:
    await core.create_namespaced_pod(NS, pod("p"))
    await custom.create_namespaced_custom_object(*GQ, quota("q"))
    raw = await core.list_namespaced_pod(NS, _preload_content=False)
    item = json.loads(await raw.read())["items"][0]
    assert "kind" not in item
    assert "apiVersion" not in item
    listed = await custom.list_namespaced_custom_object(*GQ)
    assert listed["kind"] == "GPUQuotaList"
    assert listed["items"][0]["kind"] == "GPUQuota"


async def test_pagination_reads_one_consistent_snapshot(core: Any) -> None:
    for i in range(7):
        await core.create_namespaced_secret(NS, secret(f"s{i}"))
    first = await core.list_namespaced_secret(NS, limit=3)
    assert [s.metadata.name for s in first.items] == ["s0", "s1", "s2"]
    assert first.metadata.remaining_item_count == 4
    # Changes after the first page do not leak into later pages.
    await core.delete_namespaced_secret("s5", NS)
    await core.create_namespaced_secret(NS, secret("s9"))
    second = await core.list_namespaced_secret(NS, limit=3, _continue=first.metadata._continue)
    third = await core.list_namespaced_secret(NS, limit=3, _continue=second.metadata._continue)
    assert [s.metadata.name for s in second.items + third.items] == ["s3", "s4", "s5", "s6"]
    assert third.metadata._continue is None
    assert first.metadata.resource_version == second.metadata.resource_version
    now = await core.list_namespaced_secret(NS)
    assert [s.metadata.name for s in now.items] == ["s0", "s1", "s2", "s3", "s4", "s6", "s9"]


async def test_continue_token_older_than_compaction_is_410(core: Any, fake: FakeApiServer) -> None:
    for i in range(3):
        await core.create_namespaced_secret(NS, secret(f"s{i}"))
    first = await core.list_namespaced_secret(NS, limit=1)
    await core.create_namespaced_secret(NS, secret("later"))
    fake.compact()
    with pytest.raises(ApiException) as err:
        await core.list_namespaced_secret(NS, limit=1, _continue=first.metadata._continue)
    assert err.value.status == 410
    assert status_of(err.value)["reason"] == "Expired"


async def test_list_resource_version_semantics(core: Any, fake: FakeApiServer) -> None:
    await core.create_namespaced_secret(NS, secret("a"))
    old = (await core.list_namespaced_secret(NS)).metadata.resource_version
    await core.create_namespaced_secret(NS, secret("b"))
    exact = await core.list_namespaced_secret(
        NS, resource_version=old, resource_version_match="Exact"
    )
    assert [s.metadata.name for s in exact.items] == ["a"]
    not_older = await core.list_namespaced_secret(NS, resource_version=old)
    assert len(not_older.items) == 2
    with pytest.raises(ApiException) as err:
        await core.list_namespaced_secret(NS, resource_version=str(fake.resource_version + 5))
    assert err.value.status == 504
    fake.compact()
    with pytest.raises(ApiException) as err:
        await core.list_namespaced_secret(NS, resource_version=old, resource_version_match="Exact")
    assert err.value.status == 410


# --- update and patch ----------------------------------------------------------------------


async def test_replace_is_compare_and_swap_on_resource_version(custom: Any) -> None:
    made = await custom.create_namespaced_custom_object(*GQ, quota("q"))
    made["spec"]["gpu"] = "5"
    updated = await custom.replace_namespaced_custom_object(*GQ, "q", made)
    assert int(updated["metadata"]["resourceVersion"]) > int(made["metadata"]["resourceVersion"])
    made["spec"]["gpu"] = "6"  # still carries the old version
    with pytest.raises(ApiException) as err:
        await custom.replace_namespaced_custom_object(*GQ, "q", made)
    body = status_of(err.value)
    assert (err.value.status, body["reason"]) == (409, "Conflict")
    assert body["message"] == (
        'Operation cannot be fulfilled on gpuquotas.fracgpu.io "q": the object has been '
        "modified; please apply your changes to the latest version and try again"
    )
    assert (await custom.get_namespaced_custom_object(*GQ, "q"))["spec"]["gpu"] == "5"


async def test_concurrent_replaces_from_one_version_admit_exactly_one(custom: Any) -> None:
    made = await custom.create_namespaced_custom_object(*GQ, quota("q"))

    async def bump(i: int) -> bool:
        body = json.loads(json.dumps(made))
        body["spec"]["gpu"] = str(i)
        try:
            await custom.replace_namespaced_custom_object(*GQ, "q", body)
        except ApiException as err:
            assert err.status == 409
            return False
        return True

    results = await asyncio.gather(*(bump(i) for i in range(20)))
    assert sum(results) == 1


async def test_replace_without_version_is_unconditional_for_builtins_only(
    core: Any, custom: Any
) -> None:
    await core.create_namespaced_secret(NS, secret("s"))
    body = secret("s", {"x": "y"})
    replaced = await core.replace_namespaced_secret("s", NS, body)
    assert replaced.metadata.labels == {"x": "y"}
    await custom.create_namespaced_custom_object(*GQ, quota("q"))
    with pytest.raises(ApiException) as err:
        await custom.replace_namespaced_custom_object(*GQ, "q", quota("q", "2"))
    assert err.value.status == 422
    assert "must be specified for an update" in status_of(err.value)["message"]


async def test_noop_update_keeps_version_and_emits_nothing(core: Any, fake: FakeApiServer) -> None:
    made = await core.create_namespaced_secret(NS, secret("s"))
    again = await core.replace_namespaced_secret("s", NS, made)
    assert again.metadata.resource_version == made.metadata.resource_version
    patched = await core.patch_namespaced_secret("s", NS, {"metadata": {"labels": None}})
    assert patched.metadata.resource_version == made.metadata.resource_version


async def test_patch_content_types(core: Any, custom: Any) -> None:
    await core.create_namespaced_pod(NS, pod("p", {"a": "1"}))
    # dict body → the client sends strategic-merge-patch+json
    patched = await core.patch_namespaced_pod("p", NS, {"metadata": {"labels": {"b": "2"}}})
    assert patched.metadata.labels == {"a": "1", "b": "2"}
    merged = await core.patch_namespaced_pod(
        "p",
        NS,
        {"metadata": {"labels": {"a": None}}},
        _content_type="application/merge-patch+json",
    )
    assert merged.metadata.labels == {"b": "2"}
    # list body → json-patch+json
    jp = await core.patch_namespaced_pod(
        "p", NS, [{"op": "add", "path": "/metadata/annotations", "value": {"x/y": "z"}}]
    )
    assert jp.metadata.annotations == {"x/y": "z"}
    with pytest.raises(ApiException) as err:
        await core.patch_namespaced_pod(
            "p", NS, [{"op": "test", "path": "/metadata/labels/b", "value": "9"}]
        )
    assert err.value.status == 422
    with pytest.raises(ApiException) as err:
        await core.patch_namespaced_pod("p", NS, {"spec": {"$patch": "replace"}})
    assert err.value.status == 400

    await custom.create_namespaced_custom_object(*GQ, quota("q"))
    with pytest.raises(ApiException) as err:  # a dict sent as json-patch: the client's default
        await custom.patch_namespaced_custom_object(*GQ, "q", {"spec": {"gpu": "2"}})
    assert err.value.status == 400
    with pytest.raises(ApiException) as err:
        await custom.patch_namespaced_custom_object(
            *GQ, "q", {"spec": {"gpu": "2"}}, _content_type="application/strategic-merge-patch+json"
        )
    assert err.value.status == 415
    done = await custom.patch_namespaced_custom_object(
        *GQ, "q", {"spec": {"gpu": "2"}}, _content_type="application/merge-patch+json"
    )
    assert done["spec"]["gpu"] == "2"


async def test_patch_carrying_a_stale_version_conflicts(custom: Any) -> None:
    made = await custom.create_namespaced_custom_object(*GQ, quota("q"))
    await custom.patch_namespaced_custom_object(
        *GQ, "q", {"spec": {"gpu": "2"}}, _content_type="application/merge-patch+json"
    )
    with pytest.raises(ApiException) as err:
        await custom.patch_namespaced_custom_object(
            *GQ,
            "q",
            {
                "metadata": {"resourceVersion": made["metadata"]["resourceVersion"]},
                "spec": {"gpu": "3"},
            },
            _content_type="application/merge-patch+json",
        )
    assert err.value.status == 409


async def test_status_subresource_splits_spec_and_status(custom: Any) -> None:
    made = await custom.create_namespaced_custom_object(*GQ, quota("q", status={"used": "9"}))
    assert "status" not in made  # dropped on create
    assert made["metadata"]["generation"] == 1
    main = await custom.patch_namespaced_custom_object(
        *GQ,
        "q",
        {"spec": {"gpu": "8"}, "status": {"used": "1"}},
        _content_type="application/merge-patch+json",
    )
    assert main["spec"]["gpu"] == "8"
    assert "status" not in main
    assert main["metadata"]["generation"] == 2
    sub = await custom.patch_namespaced_custom_object_status(
        *GQ,
        "q",
        {"spec": {"gpu": "1"}, "status": {"used": "0.5"}},
        _content_type="application/merge-patch+json",
    )
    assert sub["spec"]["gpu"] == "8"
    assert sub["status"] == {"used": "0.5"}
    assert sub["metadata"]["generation"] == 2
    sub["status"]["used"] = "0.7"
    replaced = await custom.replace_namespaced_custom_object_status(*GQ, "q", sub)
    assert replaced["status"]["used"] == "0.7"
    with pytest.raises(ApiException) as err:  # the status write above moved the version on
        await custom.replace_namespaced_custom_object_status(*GQ, "q", sub)
    assert err.value.status == 409


async def test_pod_spec_is_immutable_and_bound_once(core: Any) -> None:
    await core.create_namespaced_pod(NS, pod("p"))
    with pytest.raises(ApiException) as err:
        await core.patch_namespaced_pod("p", NS, {"spec": {"nodeName": "n1"}})
    assert err.value.status == 422
    assert status_of(err.value)["reason"] == "Invalid"
    await core.patch_namespaced_pod(
        "p", NS, {"spec": {"tolerations": [{"key": "k", "operator": "Exists"}]}}
    )
    assert await bind(core, "p", "n1") == 201
    assert (await core.read_namespaced_pod("p", NS)).spec.node_name == "n1"
    assert await bind(core, "p", "n2") == 409


# --- delete --------------------------------------------------------------------------------


async def test_delete_preconditions(core: Any) -> None:
    made = await core.create_namespaced_pod(NS, pod("p"))
    stale = client.V1DeleteOptions(preconditions=client.V1Preconditions(resource_version="1"))
    with pytest.raises(ApiException) as err:
        await core.delete_namespaced_pod("p", NS, body=stale)
    assert err.value.status == 409
    assert "Precondition failed" in status_of(err.value)["message"]
    wrong_uid = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid="x"))
    with pytest.raises(ApiException):
        await core.delete_namespaced_pod("p", NS, body=wrong_uid)
    good = client.V1DeleteOptions(
        preconditions=client.V1Preconditions(resource_version=made.metadata.resource_version)
    )
    deleted = await core.delete_namespaced_pod("p", NS, body=good)
    assert deleted.metadata.name == "p"
    with pytest.raises(ApiException) as err:
        await core.delete_namespaced_pod("p", NS)
    assert err.value.status == 404


async def test_finalizers_hold_deletion_until_removed(core: Any, api: Any) -> None:
    made = await core.create_namespaced_secret(
        NS, client.V1Secret(metadata=client.V1ObjectMeta(name="s", finalizers=["fracgpu.io/x"]))
    )
    w = watch.Watch()
    events: list[tuple[str, Any]] = []

    async def collect() -> None:
        async for ev in w.stream(
            core.list_namespaced_secret,
            NS,
            resource_version=made.metadata.resource_version,
            timeout_seconds=5,
        ):
            events.append((ev["type"], ev["raw_object"]))
            if ev["type"] == "DELETED":
                return

    task = asyncio.create_task(collect())
    await core.delete_namespaced_secret("s", NS)
    held = await core.read_namespaced_secret("s", NS)
    assert held.metadata.deletion_timestamp is not None
    await core.patch_namespaced_secret("s", NS, {"metadata": {"finalizers": None}})
    with pytest.raises(ApiException) as err:
        await core.read_namespaced_secret("s", NS)
    assert err.value.status == 404
    await asyncio.wait_for(task, 5)
    await w.close()
    assert [t for t, _ in events] == ["MODIFIED", "DELETED"]
    assert events[0][1]["metadata"]["deletionTimestamp"]


async def test_graceful_pod_deletion_waits_for_the_kubelet() -> None:
    async with FakeApiServer(graceful_pod_deletion=True) as fake, fake.api_client() as api:
        core = client.CoreV1Api(api)
        for name in ("bound", "unbound"):
            await core.create_namespaced_pod(NS, pod(name))
        assert await bind(core, "bound", "n1") == 201
        await core.delete_namespaced_pod("unbound", NS)
        assert fake.get("pods", "unbound", NS) is None  # never scheduled: gone at once
        terminating = await core.delete_namespaced_pod("bound", NS)
        assert terminating.metadata.deletion_grace_period_seconds == 30
        assert terminating.metadata.deletion_timestamp is not None
        assert (await core.read_namespaced_pod("bound", NS)).metadata.deletion_timestamp
        again = await core.delete_namespaced_pod("bound", NS)  # no sooner: no change
        assert again.metadata.resource_version == terminating.metadata.resource_version
        # The kubelet reports status while the pod terminates; the pod stays.
        await core.patch_namespaced_pod_status("bound", NS, {"status": {"phase": "Running"}})
        assert fake.get("pods", "bound", NS) is not None
        await core.delete_namespaced_pod("bound", NS, grace_period_seconds=0)  # the kubelet
        assert fake.get("pods", "bound", NS) is None


async def test_deleting_a_namespace_deletes_its_contents(core: Any, fake: FakeApiServer) -> None:
    await core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="team")))
    await core.create_namespaced_secret("team", secret("s"))
    await core.create_namespaced_secret(NS, secret("s"))
    await core.delete_namespace("team")
    assert [s["metadata"]["namespace"] for s in fake.objects("secrets")] == [NS]


async def test_dry_run_validates_without_persisting(core: Any, fake: FakeApiServer) -> None:
    before = fake.resource_version
    made = await core.create_namespaced_pod(NS, pod(generate="p-"), dry_run="All")
    assert made.metadata.name.startswith("p-")
    assert made.metadata.uid
    assert fake.objects("pods") == []
    assert fake.resource_version == before
    with pytest.raises(ApiException) as err:
        await core.create_namespaced_pod(NS, pod("Bad_Name"), dry_run="All")
    assert err.value.status == 422
    await core.create_namespaced_pod(NS, pod("p"))
    await core.patch_namespaced_pod("p", NS, {"metadata": {"labels": {"a": "b"}}}, dry_run="All")
    await core.delete_namespaced_pod("p", NS, dry_run="All")
    stored = fake.get("pods", "p", NS)
    assert stored is not None
    assert "labels" not in stored["metadata"]


# --- strictness ----------------------------------------------------------------------------


async def raw(
    fake: FakeApiServer, method: str, path: str, body: bytes, content_type: str = "application/json"
) -> tuple[int, dict[str, Any], Any]:
    headers = {"Authorization": f"Bearer {fake.token}", "Content-Type": content_type}
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, fake.url + path, data=body, headers=headers) as response,
    ):
        return response.status, dict(response.headers), await response.json()


async def test_malformed_and_mismatched_bodies_are_400(fake: FakeApiServer) -> None:
    pods = "/api/v1/namespaces/default/pods"
    good = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "i"}]}}
    cases = [
        b"{not json",
        b"[1, 2]",
        json.dumps({**good, "apiVersion": "v2"}).encode(),
        json.dumps({**good, "kind": "Node"}).encode(),
        json.dumps({**good, "metadata": {"name": "p", "namespace": "other"}}).encode(),
        json.dumps({**good, "metadata": {"name": "p", "resourceVersion": "3"}}).encode(),
    ]
    for body in cases:
        code, _, status = await raw(fake, "POST", pods, body)
        assert (code, status["kind"], status["reason"]) == (400, "Status", "BadRequest"), body
    code, _, _ = await raw(fake, "POST", pods, json.dumps(good).encode())
    assert code == 201
    code, _, status = await raw(fake, "PUT", pods + "/other", json.dumps(good).encode())
    assert code == 400
    assert "does not match the name on the URL" in status["message"]
    code, _, status = await raw(fake, "POST", pods, json.dumps(good).encode(), "text/plain")
    assert code == 415
    yaml_pod = b"metadata: {name: y}\nspec: {containers: [{name: c, image: i}]}\n"
    code, _, made = await raw(fake, "POST", pods, yaml_pod, "application/yaml")
    assert (code, made["metadata"]["name"]) == (201, "y")
    apply = b"metadata: {name: y}\n"
    code, _, status = await raw(fake, "PATCH", pods + "/y", apply, "application/apply-patch+yaml")
    assert code == 415
    assert "server-side apply is not modelled" in status["message"]


@pytest.mark.parametrize(
    "metadata",
    [
        {"name": "Upper"},
        {"name": "p", "labels": {"a": "has space"}},
        {"name": "p", "labels": {"bad key!": "v"}},
        {"name": "p", "annotations": {"/x": "v"}},
        {"generateName": ""},
    ],
    ids=[
        "upper-case name",
        "label value with a space",
        "label key with a bang",
        "annotation key with an empty prefix",
        "empty generateName",
    ],
)
async def test_invalid_objects_are_422(core: Any, metadata: dict[str, Any]) -> None:
    body = {"metadata": metadata, "spec": {"containers": [{"name": "c", "image": "i"}]}}
    with pytest.raises(ApiException) as err:
        await core.create_namespaced_pod(NS, body)
    assert err.value.status == 422
    assert status_of(err.value)["reason"] == "Invalid"


async def test_unknown_top_level_fields_are_dropped_with_a_warning(fake: FakeApiServer) -> None:
    body = {"metadata": {"name": "s"}, "data": {}, "bogus": 1}
    code, headers, made = await raw(
        fake, "POST", "/api/v1/namespaces/default/secrets", json.dumps(body).encode()
    )
    assert code == 201
    assert "bogus" not in made
    assert 'unknown field \\"bogus\\"' in headers["Warning"]
    code, _, status = await raw(
        fake,
        "POST",
        "/api/v1/namespaces/default/secrets?fieldValidation=Strict",
        json.dumps({**body, "metadata": {"name": "t"}}).encode(),
    )
    assert code == 400
    assert "strict decoding error" in status["message"]
    code, headers, _ = await raw(
        fake,
        "POST",
        "/api/v1/namespaces/default/secrets?fieldValidation=Ignore",
        json.dumps({**body, "metadata": {"name": "u"}}).encode(),
    )
    assert code == 201
    assert "Warning" not in headers


async def test_secrets_fold_string_data_and_respect_immutable(core: Any) -> None:
    made = await core.create_namespaced_secret(NS, secret("s"))
    assert made.data == {"k": "dg=="}
    assert made.string_data is None
    assert made.type == "Opaque"
    await core.create_namespaced_secret(
        NS,
        client.V1Secret(metadata=client.V1ObjectMeta(name="i"), data={"a": "YQ=="}, immutable=True),
    )
    with pytest.raises(ApiException) as err:
        await core.patch_namespaced_secret("i", NS, {"data": {"a": "Yg=="}})
    assert err.value.status == 422


# --- watch ---------------------------------------------------------------------------------


async def collect_events(core: Any, count: int, **kwargs: Any) -> list[tuple[str, dict[str, Any]]]:
    w = watch.Watch()
    events: list[tuple[str, dict[str, Any]]] = []
    async with w:
        async for ev in w.stream(core.list_namespaced_pod, NS, timeout_seconds=5, **kwargs):
            events.append((ev["type"], ev["raw_object"]))
            if len(events) == count:
                break
    return events


async def test_watch_streams_changes_in_order_with_typed_objects(core: Any) -> None:
    start = (await core.list_namespaced_pod(NS)).metadata.resource_version
    w = watch.Watch()
    seen: list[tuple[str, str, Any]] = []

    async def consume() -> None:
        async with w:
            async for ev in w.stream(
                core.list_namespaced_pod, NS, resource_version=start, timeout_seconds=5
            ):
                seen.append((ev["type"], ev["object"].metadata.resource_version, ev["object"]))
                if ev["type"] == "DELETED":
                    return

    task = asyncio.create_task(consume())
    await core.create_namespaced_pod(NS, pod("p"))
    await core.patch_namespaced_pod("p", NS, {"metadata": {"labels": {"a": "b"}}})
    await core.delete_namespaced_pod("p", NS)
    await asyncio.wait_for(task, 5)
    assert [t for t, _, _ in seen] == ["ADDED", "MODIFIED", "DELETED"]
    versions = [int(v) for _, v, _ in seen]
    assert versions == sorted(versions)
    assert len(set(versions)) == 3
    assert isinstance(seen[0][2], client.V1Pod)


async def test_watch_without_version_starts_with_synthetic_adds(core: Any) -> None:
    for name in ("a", "b"):
        await core.create_namespaced_pod(NS, pod(name))
    events = await collect_events(core, 2)
    assert [(t, o["metadata"]["name"]) for t, o in events] == [("ADDED", "a"), ("ADDED", "b")]


async def test_watch_replays_history_from_a_version(core: Any) -> None:
    first = await core.create_namespaced_pod(NS, pod("a"))
    await core.create_namespaced_pod(NS, pod("b"))
    await core.delete_namespaced_pod("a", NS)
    events = await collect_events(core, 2, resource_version=first.metadata.resource_version)
    assert [(t, o["metadata"]["name"]) for t, o in events] == [("ADDED", "b"), ("DELETED", "a")]


async def test_watch_with_selector_sees_objects_leave_and_enter(core: Any) -> None:
    start = (await core.create_namespaced_pod(NS, pod("p", {"app": "a"}))).metadata.resource_version
    await core.patch_namespaced_pod("p", NS, {"metadata": {"labels": {"app": "b"}}})
    await core.patch_namespaced_pod("p", NS, {"metadata": {"labels": {"app": "a"}}})
    events = await collect_events(core, 2, resource_version=start, label_selector="app=a")
    assert [t for t, _ in events] == ["DELETED", "ADDED"]


async def test_watch_bookmarks_periodic_and_on_demand(core: Any, fake: FakeApiServer) -> None:
    made = await core.create_namespaced_pod(NS, pod("p"))
    await core.create_namespaced_secret(NS, secret("elsewhere"))  # moves the global version
    events = await collect_events(
        core, 1, resource_version=made.metadata.resource_version, allow_watch_bookmarks=True
    )
    assert events[0][0] == "BOOKMARK"
    assert events[0][1]["metadata"]["resourceVersion"] == str(fake.resource_version)
    assert events[0][1]["kind"] == "Pod"

    quiet = FakeApiServer(bookmark_interval=3600)
    async with quiet, quiet.api_client() as api:
        quiet_core = client.CoreV1Api(api)
        task = asyncio.create_task(
            collect_events(quiet_core, 1, resource_version="1", allow_watch_bookmarks=True)
        )
        await quiet.wait_for_watches()
        quiet.send_bookmarks()
        events = await asyncio.wait_for(task, 5)
    assert events[0][0] == "BOOKMARK"


async def test_watch_without_bookmarks_gets_none(core: Any, fake: FakeApiServer) -> None:
    start = (await core.create_namespaced_pod(NS, pod("p"))).metadata.resource_version
    task = asyncio.create_task(collect_events(core, 1, resource_version=start))
    await fake.wait_for_watches()
    fake.send_bookmarks()
    await asyncio.sleep(0.5)  # longer than bookmark_interval
    await core.create_namespaced_pod(NS, pod("q"))
    events = await asyncio.wait_for(task, 5)
    assert [t for t, _ in events] == ["ADDED"]


async def test_watch_from_a_compacted_version_is_410_in_the_stream(
    core: Any, fake: FakeApiServer
) -> None:
    old = (await core.create_namespaced_pod(NS, pod("a"))).metadata.resource_version
    await core.create_namespaced_pod(NS, pod("b"))
    fake.compact()
    # On the wire: HTTP 200 and an ERROR event carrying a 410 Status.
    headers = {"Authorization": f"Bearer {fake.token}"}
    url = f"{fake.url}/api/v1/namespaces/default/pods?watch=1&resourceVersion={old}"
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as resp:
        assert resp.status == 200
        lines = (await resp.read()).splitlines()
    event = json.loads(lines[0])
    assert event["type"] == "ERROR"
    assert (event["object"]["code"], event["object"]["reason"]) == (410, "Expired")
    assert len(lines) == 1
    # A version the server has not reached yet is refused, not waited for forever.
    ahead = f"{fake.url}/api/v1/namespaces/default/pods?watch=1&resourceVersion=999999"
    async with aiohttp.ClientSession() as session, session.get(ahead, headers=headers) as resp:
        assert resp.status == 504
    # Through the client: watch.Watch raises ApiException(410).
    with pytest.raises(ApiException) as err:
        await collect_events(core, 1, resource_version=old)
    assert err.value.status == 410
    # The current version is still watchable after compaction.
    current = (await core.list_namespaced_pod(NS)).metadata.resource_version
    task = asyncio.create_task(collect_events(core, 1, resource_version=current))
    await core.create_namespaced_pod(NS, pod("c"))
    assert [t for t, _ in await asyncio.wait_for(task, 5)] == ["ADDED"]


async def test_watch_timeout_seconds_ends_the_stream(core: Any, fake: FakeApiServer) -> None:
    w = watch.Watch()
    async with w:
        events = [
            ev
            async for ev in w.stream(
                core.list_namespaced_pod, NS, resource_version="1", timeout_seconds=1
            )
        ]
    assert events == []
    assert fake.watch_count == 0


async def test_dropped_watches_end_or_break(core: Any, fake: FakeApiServer) -> None:
    task = asyncio.create_task(collect_events(core, 1, resource_version="1"))
    await fake.wait_for_watches()
    fake.drop_watches()
    assert await asyncio.wait_for(task, 5) == []  # a clean end: the iterator just stops
    task = asyncio.create_task(collect_events(core, 1, resource_version="1"))
    await fake.wait_for_watches()
    fake.drop_watches(abort=True)
    with pytest.raises(aiohttp.ClientError):
        await asyncio.wait_for(task, 5)


# --- faults --------------------------------------------------------------------------------


async def test_down_up_and_timed_outage(core: Any, fake: FakeApiServer) -> None:
    fake.down("503")
    with pytest.raises(ApiException) as err:
        await core.list_namespace()
    assert err.value.status == 503
    fake.down("drop")
    with pytest.raises(aiohttp.ClientError):
        await core.list_namespace()
    fake.up()
    assert len((await core.list_namespace()).items) == 4
    fake.down("503", seconds=0.2)
    with pytest.raises(ApiException):
        await core.list_namespace()
    await asyncio.sleep(0.3)
    await core.list_namespace()


async def test_forced_conflicts_for_the_next_writes(custom: Any, fake: FakeApiServer) -> None:
    await custom.create_namespaced_custom_object(*GQ, quota("q"))
    fake.fail_writes("gpuquotas", "q", NS, times=2)
    patch = {"status": {"used": "1"}}
    for _ in range(2):
        with pytest.raises(ApiException) as err:
            await custom.patch_namespaced_custom_object_status(
                *GQ, "q", patch, _content_type="application/merge-patch+json"
            )
        assert err.value.status == 409
    done = await custom.patch_namespaced_custom_object_status(
        *GQ, "q", patch, _content_type="application/merge-patch+json"
    )
    assert done["status"] == {"used": "1"}
    fake.fail_writes("gpuquotas", "q", NS, code=500)
    with pytest.raises(ApiException) as err:
        await custom.delete_namespaced_custom_object(*GQ, "q")
    assert err.value.status == 500


async def test_latency_is_added_to_every_request(core: Any, fake: FakeApiServer) -> None:
    fake.latency = 0.2
    loop = asyncio.get_running_loop()
    start = loop.time()
    await core.list_namespace()
    assert loop.time() - start >= 0.2


async def test_requests_are_recorded(core: Any, fake: FakeApiServer) -> None:
    await core.create_namespaced_pod(NS, pod("p"), dry_run="All")
    last = fake.requests[-1]
    assert (last.method, last.path, last.query) == (
        "POST",
        "/api/v1/namespaces/default/pods",
        {"dryRun": "All"},
    )


# --- the other kinds -----------------------------------------------------------------------


async def test_leases_for_leader_election(api: Any) -> None:
    coordination = client.CoordinationV1Api(api)
    lease = client.V1Lease(
        metadata=client.V1ObjectMeta(name="fracgpu-quota"),
        spec=client.V1LeaseSpec(holder_identity="a", lease_duration_seconds=15),
    )
    made = await coordination.create_namespaced_lease("kube-system", lease)
    made.spec.holder_identity = "b"
    taken = await coordination.replace_namespaced_lease("fracgpu-quota", "kube-system", made)
    assert taken.spec.holder_identity == "b"
    made.spec.holder_identity = "c"
    with pytest.raises(ApiException) as err:
        await coordination.replace_namespaced_lease("fracgpu-quota", "kube-system", made)
    assert err.value.status == 409


async def test_leader_election_elects_exactly_one(fake: FakeApiServer, api: Any) -> None:
    """kubernetes-asyncio's own LeaderElection over a Lease: one candidate leads, the other
    loses the create race (409) and then sees a lease held by a live leader."""
    from kubernetes_asyncio.leaderelection import electionconfig, leaderelection
    from kubernetes_asyncio.leaderelection.resourcelock.leaselock import LeaseLock

    leaders: list[str] = []
    first = asyncio.Event()

    def candidate(identity: str) -> Any:
        async def started() -> None:
            leaders.append(identity)
            first.set()

        async def stopped() -> None:
            return None

        lock = LeaseLock("fracgpu-quota", "kube-system", identity, api)
        cfg = electionconfig.Config(
            lock,
            lease_duration=3,
            renew_deadline=2,
            retry_period=1,
            onstarted_leading=started,
            onstopped_leading=stopped,
        )
        return asyncio.create_task(leaderelection.LeaderElection(cfg).run())

    tasks = [candidate("a"), candidate("b")]
    try:
        await asyncio.wait_for(first.wait(), 5)
        await asyncio.sleep(1.5)  # more than one retry period of the loser
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert len(leaders) == 1
    lease = fake.get("leases", "fracgpu-quota", "kube-system")
    assert lease is not None
    assert lease["spec"]["holderIdentity"] == leaders[0]


async def test_webhook_configurations(api: Any) -> None:
    admission = client.AdmissionregistrationV1Api(api)
    webhook = client.V1MutatingWebhook(
        name="mutate.fracgpu.io",
        admission_review_versions=["v1"],
        side_effects="NoneOnDryRun",
        client_config=client.AdmissionregistrationV1WebhookClientConfig(
            service=client.AdmissionregistrationV1ServiceReference(
                name="fracgpu", namespace="fracgpu", path="/mutate"
            )
        ),
    )
    made = await admission.create_mutating_webhook_configuration(
        client.V1MutatingWebhookConfiguration(
            metadata=client.V1ObjectMeta(name="fracgpu"), webhooks=[webhook]
        )
    )
    assert made.metadata.generation == 1
    patched = await admission.patch_mutating_webhook_configuration(
        "fracgpu", [{"op": "add", "path": "/webhooks/0/clientConfig/caBundle", "value": "Q0E="}]
    )
    assert patched.webhooks[0].client_config.ca_bundle == "Q0E="
    assert patched.metadata.generation == 2
    await admission.create_validating_webhook_configuration(
        client.V1ValidatingWebhookConfiguration(metadata=client.V1ObjectMeta(name="fracgpu"))
    )
    listed = await admission.list_validating_webhook_configuration()
    assert [c.metadata.name for c in listed.items] == ["fracgpu"]


async def test_events_and_nodes(core: Any, fake: FakeApiServer) -> None:
    event = client.CoreV1Event(
        metadata=client.V1ObjectMeta(generate_name="quota-"),
        involved_object=client.V1ObjectReference(kind="Pod", name="p", namespace=NS),
        reason="QuotaExceeded",
        message="m",
        type="Warning",
    )
    await core.create_namespaced_event(NS, event)
    listed = await core.list_namespaced_event(NS, field_selector="involvedObject.name=p")
    assert [e.reason for e in listed.items] == ["QuotaExceeded"]
    node = client.V1Node(
        metadata=client.V1ObjectMeta(name="n1", labels={"fracgpu.io/gpu.product": "A100"})
    )
    await core.create_node(node)
    await core.patch_node_status("n1", {"status": {"capacity": {"fracgpu.io/core": "100"}}})
    read = await core.read_node("n1")
    assert read.status.capacity == {"fracgpu.io/core": "100"}
    assert read.metadata.labels == {"fracgpu.io/gpu.product": "A100"}


async def test_direct_access_emits_watch_events(core: Any, fake: FakeApiServer) -> None:
    made = await core.create_namespaced_pod(NS, pod("p"))
    task = asyncio.create_task(
        collect_events(core, 1, resource_version=made.metadata.resource_version)
    )
    await fake.wait_for_watches()
    stored = fake.get("pods", "p", NS)
    assert stored is not None
    stored["status"]["phase"] = "Succeeded"
    fake.put(stored)
    events = await asyncio.wait_for(task, 5)
    assert events[0][0] == "MODIFIED"
    assert events[0][1]["status"]["phase"] == "Succeeded"


async def test_discovery(fake: FakeApiServer) -> None:
    headers = {"Authorization": f"Bearer {fake.token}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.get(fake.url + "/apis/fracgpu.io/v1") as resp:
            resources = await resp.json()
        async with session.get(fake.url + "/apis/nope/v1/things") as resp:
            assert resp.status == 404
    names = [r["name"] for r in resources["resources"]]
    assert names == ["gpuquotas", "gpuquotas/status"]
