"""core/kube.py against the fake API server: client factory, raw calls, typed errors, and the
informer's list → watch → relist loop through syncs, events, bookmarks, 410s and dropped
connections."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.config.incluster_config import SERVICE_TOKEN_FILENAME
from prometheus_client import CollectorRegistry

from core.informer import EventType, Informer, InformerMetrics, Informers, InformerSettings
from core.kube import (
    NODES,
    PODS,
    SECRETS,
    KubeConfigError,
    KubeConflict,
    KubeError,
    KubeGone,
    KubeInvalid,
    KubeNotFound,
    Resource,
    call_json,
    kube_client,
    load_configuration,
    status_error,
)
from testkit.apiserver import FakeApiServer, RequestRecord
from tests.support import eventually

IN_A_POD = os.path.exists(SERVICE_TOKEN_FILENAME)


def node(name: str, **labels: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}


def pod_body(name: str, **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "c", "image": "i"}]},
    }


class Recorder:
    """An informer handler that remembers (event, name) and lets a test wait for a count."""

    def __init__(self) -> None:
        self.events: list[tuple[EventType, str]] = []
        self._changed = asyncio.Condition()

    async def __call__(self, kind: EventType, obj: dict[str, Any]) -> None:
        self.events.append((kind, obj["metadata"]["name"]))
        async with self._changed:
            self._changed.notify_all()

    async def wait_for(self, count: int, within_s: float = 5.0) -> list[tuple[EventType, str]]:
        async with asyncio.timeout(within_s), self._changed:
            await self._changed.wait_for(lambda: len(self.events) >= count)
        return self.events


@pytest.fixture
async def fake() -> AsyncIterator[FakeApiServer]:
    async with FakeApiServer(bookmark_interval=0.1) as server:
        yield server


@pytest.fixture
async def api(fake: FakeApiServer, tmp_path: Path) -> AsyncIterator[Any]:
    async with kube_client(fake.kubeconfig(tmp_path / "kubeconfig")) as client:
        yield client


def informer(
    api: Any, resource: Resource = NODES, *, page_size: int = 500, **kwargs: Any
) -> Informer:
    # Quick backoff: the tests take the API server down and bring it back.
    settings = InformerSettings(page_size=page_size, backoff_initial_s=0.05, backoff_max_s=0.2)
    return Informer(api, resource, settings=settings, **kwargs)


# --- client factory and raw calls -----------------------------------------------------------


async def test_kube_client_from_a_kubeconfig_and_from_env(
    fake: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = fake.kubeconfig(tmp_path / "kc")
    async with kube_client(path) as api:
        listed = await call_json(api, "GET", "/api/v1/namespaces")
    assert [n["metadata"]["name"] for n in listed["items"]][:1] == ["default"]
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(path))
    configuration = await load_configuration()
    assert configuration.host == fake.url


@pytest.mark.parametrize(
    ("no_proxy", "through_proxy"),
    [
        pytest.param("", True, id="proxy-from-the-environment"),
        pytest.param("127.0.0.1", False, id="no-proxy-bypasses-it"),
    ],
)
async def test_the_environment_is_read_once_not_per_request(
    fake: FakeApiServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_proxy: str,
    through_proxy: bool,
) -> None:
    """HTTP(S)_PROXY and NO_PROXY are honoured, as client-go honours them, but resolved when the
    client is made: kubernetes-asyncio's session would read them (and ~/.netrc) in a worker
    thread on every request, on the path of every quota decision."""
    import aiohttp.helpers
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    seen: list[str] = []

    async def proxy(request: web.Request) -> web.Response:  # a forward proxy that answers itself
        seen.append(str(request.url))
        return web.json_response({"kind": "NamespaceList", "items": []})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", proxy)
    async with TestServer(app) as server:
        monkeypatch.setenv("HTTP_PROXY", str(server.make_url("")))
        monkeypatch.setenv("NO_PROXY", no_proxy)
        lookups: list[object] = []
        real_lookup = aiohttp.helpers.get_env_proxy_for_url

        def counted(url: Any) -> Any:
            lookups.append(url)
            return real_lookup(url)

        monkeypatch.setattr(aiohttp.helpers, "get_env_proxy_for_url", counted)
        monkeypatch.setattr("aiohttp.client.get_env_proxy_for_url", counted)
        async with kube_client(fake.kubeconfig(tmp_path / "kc")) as api:
            created = len(lookups)
            for _ in range(3):
                await call_json(api, "GET", "/api/v1/namespaces")
    assert created == 1  # resolved once, for the API server's address
    assert len(lookups) == created  # and never again per request
    assert bool(seen) == through_proxy


async def test_kube_client_without_any_configuration_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(KubeConfigError, match="pass a kubeconfig path or run in-cluster"):
        await load_configuration()
    with pytest.raises(KubeConfigError, match="does not exist"):
        await load_configuration(tmp_path / "missing")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "gone"))
    with pytest.raises(KubeConfigError, match="gone' names no file"):
        await load_configuration()


@pytest.mark.skipif(IN_A_POD, reason="running in a pod: a service-account token exists here")
async def test_in_a_pod_without_a_kubeconfig_the_service_account_is_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kubernetes_asyncio.config import ConfigException

    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    # No service-account token on this machine: the in-cluster loader (not a kubeconfig) says so.
    with pytest.raises(ConfigException, match="token"):
        await load_configuration()


async def test_call_json_raises_kube_error_from_status(api: Any) -> None:
    with pytest.raises(KubeError) as err:
        await call_json(api, "GET", PODS.path("default", "nope"))
    assert (err.value.status, err.value.reason) == (404, "NotFound")
    assert err.value.message == 'pods "nope" not found'
    made = await call_json(api, "POST", PODS.path("default"), body=pod_body("p"))
    assert made["metadata"]["name"] == "p"


def test_resource_paths() -> None:
    assert PODS.path() == "/api/v1/pods"
    assert PODS.path("a", "p") == "/api/v1/namespaces/a/pods/p"
    assert NODES.path("ignored", "n") == "/api/v1/nodes/n"
    quotas = Resource("fracgpu.io", "v1", "gpuquotas", namespaced=True)
    assert quotas.path("t") == "/apis/fracgpu.io/v1/namespaces/t/gpuquotas"


# --- informer -------------------------------------------------------------------------------


async def test_initial_sync_then_live_events(api: Any, fake: FakeApiServer) -> None:
    fake.put(node("a", gpu="x"))
    fake.put(node("b"))
    recorder = Recorder()
    async with informer(api, handler=recorder) as inf:
        assert not inf.has_synced
        await inf.wait_synced(5)
        assert inf.has_synced
        assert sorted(recorder.events) == [("ADDED", "a"), ("ADDED", "b")]
        assert inf.resource_version == str(fake.resource_version)
        await fake.wait_for_watches()
        await call_json(api, "POST", NODES.path(), body=node("c"))
        await call_json(
            api,
            "PATCH",
            NODES.path(name="a"),
            body={"metadata": {"labels": {"gpu": "y"}}},
            content_type="application/merge-patch+json",
        )
        await call_json(api, "DELETE", NODES.path(name="b"))
        events = await recorder.wait_for(5)
        assert events[2:] == [("ADDED", "c"), ("MODIFIED", "a"), ("DELETED", "b")]
        assert sorted(o["metadata"]["name"] for o in inf.objects()) == ["a", "c"]
        got = inf.get("a")
        assert got is not None
        assert got["metadata"]["labels"] == {"gpu": "y"}
        assert inf.resource_version == str(fake.resource_version)
        assert inf.stats.lists == 1


async def test_bookmarks_advance_the_version_without_events(api: Any, fake: FakeApiServer) -> None:
    fake.put(node("a"))
    recorder = Recorder()
    async with informer(api, handler=recorder) as inf:
        await inf.wait_synced(5)
        await fake.wait_for_watches()
        before = inf.resource_version
        await call_json(api, "POST", SECRETS.path("default"), body={"metadata": {"name": "s"}})
        await eventually(lambda: inf.resource_version == str(fake.resource_version))
        assert int(inf.resource_version) > int(before)
        assert inf.stats.bookmarks >= 1
        assert recorder.events == [("ADDED", "a")]
        # A watch that ends now resumes from the bookmark, which compaction has not reached.
        fake.compact()
        fake.drop_watches()
        await call_json(api, "POST", NODES.path(), body=node("b"))
        await recorder.wait_for(2)
        assert inf.stats.relists_410 == 0
        assert inf.stats.lists == 1


async def test_410_relists_with_synthetic_deletes(api: Any, fake: FakeApiServer) -> None:
    for name in ("a", "b", "c"):
        fake.put(node(name))
    recorder = Recorder()
    async with informer(api, handler=recorder) as inf:
        await inf.wait_synced(5)
        await fake.wait_for_watches()
        fake.down("503")  # drops the watch; the informer retries into 503s
        fake.remove("nodes", "a")
        changed = fake.get("nodes", "b")
        assert changed is not None
        changed["metadata"]["labels"] = {"gpu": "z"}
        fake.put(changed)
        fake.put(node("d"))
        fake.compact()
        fake.up()
        events = await recorder.wait_for(6)
        assert events[:3] == [("ADDED", "a"), ("ADDED", "b"), ("ADDED", "c")]
        assert sorted(events[3:]) == [("ADDED", "d"), ("DELETED", "a"), ("MODIFIED", "b")]
        assert events[3] == ("DELETED", "a")  # deletes come first
        assert inf.stats.relists_410 == 1
        assert inf.stats.lists == 2
        assert sorted(o["metadata"]["name"] for o in inf.objects()) == ["b", "c", "d"]
        assert inf.resource_version == str(fake.resource_version)
        # and it keeps watching afterwards
        await fake.wait_for_watches()
        await call_json(api, "DELETE", NODES.path(name="c"))
        assert (await recorder.wait_for(7))[6] == ("DELETED", "c")


async def test_connection_drop_recovers_by_rewatching_from_its_version(
    api: Any, fake: FakeApiServer
) -> None:
    recorder = Recorder()
    async with informer(api, handler=recorder) as inf:
        await inf.wait_synced(5)
        await fake.wait_for_watches()
        fake.drop_watches(abort=True)
        fake.put(node("a"))  # lands while no watch is open; replayed on reconnect
        assert await recorder.wait_for(1) == [("ADDED", "a")]
        assert inf.stats.errors >= 1
        assert inf.stats.lists == 1
        assert inf.stats.relists_410 == 0
        fake.down("drop", seconds=0.3)
        fake.put(node("b"))
        assert (await recorder.wait_for(2))[1] == ("ADDED", "b")
        assert inf.stats.lists == 1


async def test_clean_watch_end_rewatches_without_relisting(api: Any, fake: FakeApiServer) -> None:
    recorder = Recorder()
    async with informer(api, handler=recorder) as inf:
        await inf.wait_synced(5)
        await fake.wait_for_watches()
        for i in range(3):
            fake.drop_watches()
            fake.put(node(f"n{i}"))
            await recorder.wait_for(i + 1)  # delivered by the next watch, which is now open
        assert inf.stats.lists == 1
        assert inf.stats.errors == 0
        assert inf.stats.watches == 4
        last = [r for r in fake.requests if r.query.get("watch") == "true"][-1]
        assert last.query["allowWatchBookmarks"] == "true"
        assert 300 <= int(last.query["timeoutSeconds"]) <= 600  # jittered, default 300 s


async def test_list_is_paginated_and_failures_back_off(api: Any, fake: FakeApiServer) -> None:
    for i in range(5):
        fake.put(node(f"n{i}"))
    fake.down("503", seconds=0.3)
    async with informer(api, page_size=2) as inf:
        await inf.wait_synced(5)
        assert len(inf) == 5
        assert inf.stats.errors >= 1
    pages = [r for r in fake.requests if r.path == "/api/v1/nodes" and "watch" not in r.query]
    assert [("continue" in r.query) for r in pages[-3:]] == [False, True, True]


async def test_an_expired_continue_token_restarts_the_list(api: Any, fake: FakeApiServer) -> None:
    for i in range(4):
        fake.put(node(f"n{i}"))
    expired: list[str] = []

    def expire_between_pages(record: RequestRecord) -> None:
        if "continue" in record.query and not expired:
            expired.append(record.query["continue"])
            fake.put(node("late"))
            fake.compact()

    fake.on_request = expire_between_pages
    async with informer(api, page_size=2) as inf:
        await inf.wait_synced(5)
        assert expired
        assert inf.stats.relists_410 == 1
        assert inf.stats.lists == 1
        assert sorted(o["metadata"]["name"] for o in inf.objects()) == [
            "late",
            "n0",
            "n1",
            "n2",
            "n3",
        ]


async def test_namespace_and_selectors_scope_the_cache(api: Any, fake: FakeApiServer) -> None:
    await call_json(api, "POST", "/api/v1/namespaces", body={"metadata": {"name": "team"}})
    await call_json(api, "POST", PODS.path("team"), body=pod_body("in", app="x"))
    await call_json(api, "POST", PODS.path("team"), body=pod_body("other", app="y"))
    await call_json(api, "POST", PODS.path("default"), body=pod_body("elsewhere", app="x"))
    recorder = Recorder()
    async with informer(
        api, PODS, namespace="team", label_selector="app=x", handler=recorder
    ) as inf:
        await inf.wait_synced(5)
        await fake.wait_for_watches()
        assert [o["metadata"]["name"] for o in inf.objects()] == ["in"]
        assert inf.get("in", "team") is not None
        await call_json(
            api,
            "PATCH",
            PODS.path("team", "in"),
            body={"metadata": {"labels": {"app": "y"}}},
            content_type="application/merge-patch+json",
        )
        assert (await recorder.wait_for(2))[1] == ("DELETED", "in")
        assert len(inf) == 0


async def test_failing_handlers_are_contained_and_iterators_see_events(
    api: Any, fake: FakeApiServer
) -> None:
    def broken(kind: EventType, obj: dict[str, Any]) -> None:
        raise RuntimeError("handler bug")

    async with informer(api, handler=broken) as inf:
        stream = inf.events()
        first = asyncio.ensure_future(anext(stream))
        await inf.wait_synced(5)
        await fake.wait_for_watches()
        fake.put(node("a"))
        kind, obj = await asyncio.wait_for(first, 5)
        assert (kind, obj["metadata"]["name"]) == ("ADDED", "a")
        assert inf.stats.handler_errors == 1
        await stream.aclose()


async def test_metrics_count_lists_relists_errors_and_events(api: Any, fake: FakeApiServer) -> None:
    registry = CollectorRegistry()
    metrics = InformerMetrics(registry)
    fake.put(node("a"))
    recorder = Recorder()
    async with informer(api, metrics=metrics, handler=recorder, name="nodes") as inf:
        await inf.wait_synced(5)
        await fake.wait_for_watches()
        fake.down("503")
        fake.remove("nodes", "a")
        fake.compact()
        fake.up()
        await recorder.wait_for(2)
        assert registry.get_sample_value("fracgpu_informer_synced", {"informer": "nodes"}) == 1

    def sample(name: str, **labels: str) -> float | None:
        value: float | None = registry.get_sample_value(name, {"informer": "nodes", **labels})
        return value

    assert sample("fracgpu_informer_lists_total") == 2
    assert sample("fracgpu_informer_relists_410_total") == 1
    assert (sample("fracgpu_informer_errors_total") or 0) >= 1
    assert sample("fracgpu_informer_events_total", type="ADDED") == 1
    assert sample("fracgpu_informer_events_total", type="DELETED") == 1
    assert sample("fracgpu_informer_objects") == 0
    assert sample("fracgpu_informer_synced") == 0  # stopped: started again, it lists afresh


# --- shared informers: one watch per kind and selector in a process --------------------------

SHARING_CASES = {
    "same kind, same selectors: one informer": ((PODS, ""), (PODS, ""), True),
    "another field selector: its own": ((PODS, ""), (PODS, "status.phase=Pending"), False),
    "another kind: its own": ((PODS, ""), (NODES, ""), False),
}


@pytest.mark.parametrize("first, second, shared", SHARING_CASES.values(), ids=SHARING_CASES)
def test_informers_hand_out_one_informer_per_kind_and_selector(
    first: tuple[Resource, str], second: tuple[Resource, str], shared: bool
) -> None:
    informers = Informers(api=None)
    a = informers.of(first[0], field_selector=first[1])
    b = informers.of(second[0], field_selector=second[1])
    assert (a is b) == shared


def _watches(fake: FakeApiServer, plural: str) -> int:
    return sum(1 for w in fake.store.watchers if w.kind.plural == plural)


async def test_a_shared_informer_watches_once_while_anyone_uses_it(
    api: Any, fake: FakeApiServer
) -> None:
    fake.put(node("a"))
    informers = Informers(api, settings=InformerSettings(backoff_initial_s=0.05))
    first, second = informers.of(NODES), informers.of(NODES)
    held: set[str] = set()  # what a handler that stays attached (an inventory) holds

    def follow(kind: EventType, obj: dict[str, Any]) -> None:
        (held.discard if kind == "DELETED" else held.add)(obj["metadata"]["name"])

    first.add_handler(follow)
    first.start()
    second.start()
    await first.wait_synced(5)
    await fake.wait_for_watches()
    assert _watches(fake, "nodes") == 1
    await first.stop()  # one user left: it keeps watching
    fake.put(node("b"))
    await eventually(lambda: second.get("b") is not None)
    assert _watches(fake, "nodes") == 1
    await second.stop()  # the last user: the watch ends, and so does what it knew
    await eventually(lambda: _watches(fake, "nodes") == 0)
    assert not second.has_synced and len(second) == 0
    assert held == set()  # told that it forgot "a" and "b"
    fake.remove("nodes", "a")
    second.start()  # used again: it lists afresh
    await second.wait_synced(5)
    assert [o["metadata"]["name"] for o in second.objects()] == ["b"]
    assert held == {"b"}  # "a", removed while nobody watched, does not linger
    await second.stop()


async def test_a_handler_added_after_the_list_is_told_of_every_cached_object(
    api: Any, fake: FakeApiServer
) -> None:
    fake.put(node("a"))
    fake.put(node("b"))
    async with informer(api) as inf:
        await inf.wait_synced(5)
        await fake.wait_for_watches()
        seen: list[tuple[str, str]] = []
        inf.add_handler(lambda kind, obj: seen.append((kind, obj["metadata"]["name"])))
        assert sorted(seen) == [("ADDED", "a"), ("ADDED", "b")]
        fake.put(node("c"))
        await eventually(lambda: ("ADDED", "c") in seen)
        with pytest.raises(TypeError, match="must not be async"):
            inf.add_handler(Recorder())


async def test_stop_cancels_cleanly(api: Any, fake: FakeApiServer) -> None:
    inf = informer(api)
    inf.start()
    await inf.wait_synced(5)
    await fake.wait_for_watches()
    await inf.stop()
    await inf.stop()  # idempotent
    await eventually(lambda: fake.watch_count == 0)


@pytest.mark.parametrize(
    ("status", "body", "kind"),
    [
        pytest.param(404, {"kind": "Status", "code": 404}, KubeNotFound, id="not found"),
        pytest.param(409, {"kind": "Status", "code": 409}, KubeConflict, id="conflict"),
        pytest.param(410, {"kind": "Status", "code": 410}, KubeGone, id="gone"),
        pytest.param(422, {"kind": "Status", "code": 422}, KubeInvalid, id="invalid"),
        pytest.param(500, {"kind": "Status", "code": 500}, KubeError, id="other code is the base"),
        pytest.param(200, {"kind": "Status", "code": 410}, KubeGone, id="watch ERROR event in 200"),
        pytest.param(404, None, KubeNotFound, id="404 page not found, no Status body"),
    ],
)
def test_status_error_is_typed_by_code(
    status: int, body: dict[str, object] | None, kind: type[KubeError]
) -> None:
    err = status_error(status, body, b"404 page not found")
    assert type(err) is kind


def test_status_error_keeps_the_message() -> None:
    err = status_error(422, {"kind": "Status", "code": 422, "reason": "Invalid", "message": "m"})
    assert err.reason == "Invalid"
    assert err.message == "m"


async def test_a_missing_object_raises_not_found(api: Any) -> None:
    with pytest.raises(KubeNotFound):
        await call_json(api, "GET", PODS.path("default", "nothing-here"))
