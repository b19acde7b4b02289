"""FakeApiServer: a strict test double of kube-apiserver at the HTTP boundary.

It is a fake, not a Kubernetes: real HTTP (aiohttp on 127.0.0.1, an ephemeral port, plain http with
a bearer token) so that the real kubernetes-asyncio client, typed APIs and `watch.Watch` included,
talks to it unchanged, and the semantics that clients depend on are the real ones:

- one global resourceVersion counter (a string on the wire); every write bumps it; a write that
  changes nothing is a no-op that keeps the version and emits no event;
- create → 201 (uid, creationTimestamp, generateName; 409 AlreadyExists; namespaced objects need
  an existing, non-terminating namespace); get → 404 NotFound as a `Status` object;
- list → `metadata.resourceVersion`, labelSelector (=, ==, !=, in, notin, exists, !exists),
  fieldSelector (per kind, unsupported fields → 400), limit/continue pagination over a consistent
  snapshot (a continue token older than the compacted history → 410 Expired);
- PUT replace: 409 Conflict on a stale metadata.resourceVersion; unconditional when absent
  (except custom resources, which require it, as the real server does: 422);
- PATCH: application/merge-patch+json (RFC 7386), application/json-patch+json (RFC 6902, a failed
  op → 422), application/strategic-merge-patch+json. DEPARTURE: strategic merge is treated as a
  merge patch (lists are replaced, not merged by key); `$patch`/`$retainKeys`/`$setElementOrder`
  directives are refused with 400 so that no test passes by accident. Custom resources refuse
  strategic merge with 415 (real behaviour). Server-side apply is not modelled (415);
- status subresource (pods, nodes, namespaces, gpuquotas): the main resource ignores status
  changes, `/status` ignores everything but status; `metadata.generation` is bumped on spec
  changes for custom resources and webhook configurations;
- DELETE with preconditions (resourceVersion, uid → 409); objects with finalizers get a
  deletionTimestamp and go away when the last finalizer is removed; deleting a namespace deletes
  its contents at once (DEPARTURE: no Terminating phase); pods bound to a node are deleted
  gracefully only with `graceful_pod_deletion=True` (deletionTimestamp = now + grace period, gone
  when deleted again with gracePeriodSeconds=0, as kubelet does), otherwise at once;
- watch (`?watch=1`): a chunked stream of JSON lines, ADDED/MODIFIED/DELETED (selector-aware: an
  object that stops matching is DELETED for that watch), BOOKMARK when `allowWatchBookmarks=true`
  (every `bookmark_interval` seconds and on demand), `timeoutSeconds`, replay from a given version,
  and 410 Gone as an ERROR event in the stream when that version was compacted away;
- dryRun=All validates and answers without persisting; unknown top-level fields are dropped with a
  `Warning` header (or refused under fieldValidation=Strict); malformed JSON, wrong apiVersion or
  kind, name or namespace mismatch between URL and body → 400; invalid names and labels → 422;
  pod spec updates outside the mutable fields → 422; `pods/binding` sets spec.nodeName once;
  `serviceaccounts/<name>/token` (TokenRequest) answers with the fake's own token.
- resource.k8s.io/v1 (ResourceSlice, ResourceClaim, ResourceClaimTemplate, DeviceClass): the
  validation a 1.36 server applied and the quantities it re-serialised (`draobjects`, which also
  has the scheduler-like first-fit allocator for claims).

Fault injection and cost, all under the test's control: `latency` (every request),
`write_latency` (every write, as an etcd commit), `fail_writes()` (forced 409 or another
code for the next N writes to one object), `down()`/`up()` (503 or dropped connections),
`drop_watches()`, `compact()`, `send_bookmarks()`, and `on_request` (a hook called before each
request is served). `requests` records every request.

Not modelled: authorization (any request with the token is allowed), admission webhooks, defaulting
beyond a few pod fields, server-side apply, protobuf, field managers, most validation.

This module is the HTTP layer. Beside it: `apistore` (versions, history, snapshots, watchers),
`kinds` (per-kind behaviour), `selectors`, `patching`, `objectrules` (validation and defaults) and
`apierrors` (the `Status` failures). docs/testing.md is the user's guide.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import inspect
import json
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from testkit.apierrors import (
    STALE,
    ApiError,
    bad_request,
    conflict,
    invalid,
    not_found,
)
from testkit.apistore import (
    Bookmark,
    Change,
    Close,
    Key,
    Obj,
    Store,
    TooOld,
    Watcher,
    clone,
    key_of,
)
from testkit.kinds import DEFAULT_KINDS, NAMESPACE, POD, SERVICE_ACCOUNT, Kind
from testkit.objectrules import (
    GENERATE_ALPHABET,
    check_immutable,
    defaults_on_create,
    fold_secret_data,
    now,
    rewrite,
    validate,
)
from testkit.patching import apply_patch
from testkit.selectors import SelectorError, compile_selectors

DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
MAX_BODY_BYTES = 3 * 1024 * 1024  # kube-apiserver's request body limit


@dataclass(frozen=True)
class Route:
    kind: Kind
    namespace: str | None
    name: str | None
    sub: str | None


@dataclass(frozen=True)
class RequestRecord:
    method: str
    path: str
    query: dict[str, str]
    body_bytes: int = 0  # the request body's length (what a write costs to send and store)


@dataclass
class _ForcedFailure:
    remaining: int
    code: int


def _truthy(value: str | None) -> bool:
    return value in ("true", "1", "True")


def _content_outside(obj: Mapping[str, Any], *skip: str) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in skip}


class FakeApiServer:
    """A strict fake kube-apiserver. Use as `async with FakeApiServer() as fake:`."""

    def __init__(
        self,
        *,
        kinds: Iterable[Kind] = DEFAULT_KINDS,
        namespaces: Iterable[str] = DEFAULT_NAMESPACES,
        bookmark_interval: float = 60.0,
        graceful_pod_deletion: bool = False,
    ) -> None:
        """`graceful_pod_deletion=True` makes deleting a pod bound to a node set its
        deletionTimestamp (now + grace period) and keep it until deleted again with
        gracePeriodSeconds=0 (what kubelet does) or `remove()`d; off, pods go at once."""
        self.store = Store()
        self.token = secrets.token_hex(16)
        self.bookmark_interval = bookmark_interval
        self.graceful_pod_deletion = graceful_pod_deletion
        self.latency = 0.0
        # Added to every write (create, replace, patch, delete): what committing to etcd costs a
        # real API server, so that a path with one more write is slower, as it is there.
        self.write_latency = 0.0
        # Called with each request before it is served: the test's hook to act at an exact point
        # (compact between two pages, change an object between a read and a write).
        self.on_request: Callable[[RequestRecord], Awaitable[None] | None] | None = None
        self.requests: list[RequestRecord] = []
        self._kinds: dict[tuple[str, str, str], Kind] = {}
        self._by_plural: dict[str, Kind] = {}
        for kind in kinds:
            self.register(kind)
        self._down: str | None = None
        self._up_handle: asyncio.TimerHandle | None = None
        self._forced: dict[tuple[Kind, Key], _ForcedFailure] = {}
        self._runner: web.AppRunner | None = None
        self._watch_opened = asyncio.Event()
        self._port = 0
        for name in namespaces:
            self.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})

    # --- lifecycle -----------------------------------------------------------------------

    def register(self, kind: Kind) -> None:
        """Serve another kind (as installing a CRD would)."""
        self._kinds[(kind.group, kind.version, kind.plural)] = kind
        self._by_plural[kind.plural] = kind

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(
            app, access_log=None, shutdown_timeout=0.5, handler_cancellation=True
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        sockets = getattr(server, "sockets", None)
        assert sockets
        self._port = sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._up_handle is not None:
            self._up_handle.cancel()
        self.store.close_all(abort=True)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeApiServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def kubeconfig(self, path: Path | str) -> Path:
        """Write a kubeconfig that `kubernetes_asyncio.config.load_kube_config` accepts."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": self.token}}],
            "contexts": [
                {
                    "name": "fake",
                    "context": {"cluster": "fake", "user": "fake", "namespace": "default"},
                }
            ],
            "current-context": "fake",
        }
        target = Path(path)
        target.write_text(yaml.safe_dump(config))
        target.chmod(0o600)
        return target

    @asynccontextmanager
    async def api_client(self) -> AsyncIterator[Any]:
        """A kubernetes_asyncio ApiClient configured for this server, closed on exit."""
        from kubernetes_asyncio.client import Configuration

        from core.kube import api_client

        config = Configuration(host=self.url)
        config.api_key = {"BearerToken": f"Bearer {self.token}"}
        client = api_client(config)
        try:
            yield client
        finally:
            await client.close()

    # --- fault injection -----------------------------------------------------------------

    def down(self, mode: str = "503", seconds: float | None = None) -> None:
        """Stop serving: every request gets 503 ("503") or has its connection dropped ("drop").
        Open watches are dropped either way. With `seconds`, come back up after that long."""
        if mode not in ("503", "drop"):
            raise ValueError(f"down(mode={mode!r}): mode must be '503' or 'drop'")
        self._down = mode
        self.store.close_all(abort=True)
        if self._up_handle is not None:
            self._up_handle.cancel()
            self._up_handle = None
        if seconds is not None:
            self._up_handle = asyncio.get_running_loop().call_later(seconds, self.up)

    def up(self) -> None:
        self._down = None
        if self._up_handle is not None:
            self._up_handle.cancel()
            self._up_handle = None

    def drop_watches(self, *, abort: bool = False) -> None:
        """End every open watch: cleanly (as a server-side timeout does) or by dropping the
        connection mid-stream (`abort=True`)."""
        self.store.close_all(abort=abort)

    def send_bookmarks(self) -> None:
        """Send a BOOKMARK at the current version to every watch that allows bookmarks."""
        self.store.bookmark_all()

    def compact(self, upto: int | None = None) -> None:
        """Forget history up to `upto` (default: now): older watch/continue versions get 410."""
        self.store.compact(upto)

    def fail_writes(
        self,
        plural: str,
        name: str,
        namespace: str | None = None,
        *,
        times: int = 1,
        code: int = 409,
    ) -> None:
        """Make the next `times` writes (PUT, PATCH, DELETE, status included) to one object fail
        with `code` (409 is a resourceVersion conflict, as if another writer had won)."""
        kind = self.kind(plural)
        self._forced[(kind, (namespace or "", name))] = _ForcedFailure(times, code)

    @property
    def watch_count(self) -> int:
        return len(self.store.watchers)

    async def wait_for_watches(self, count: int = 1, within_s: float = 5.0) -> None:
        """Wait until at least `count` watches are open (so a test's change lands in them)."""
        async with asyncio.timeout(within_s):
            while self.watch_count < count:
                self._watch_opened.clear()
                await self._watch_opened.wait()

    # --- direct access for tests (no HTTP, no validation; versions and events as usual) ---

    def kind(self, plural: str) -> Kind:
        try:
            return self._by_plural[plural]
        except KeyError:
            raise KeyError(f"the fake serves no resource {plural!r}; register() its Kind") from None

    @property
    def resource_version(self) -> int:
        return self.store.rv

    def get(self, plural: str, name: str, namespace: str | None = None) -> Obj | None:
        return self.store.get(self.kind(plural), (namespace or "", name))

    def objects(self, plural: str, namespace: str | None = None) -> list[Obj]:
        kind = self.kind(plural)
        return [
            clone(obj)
            for key, obj in sorted(self.store.snapshot(kind, self.store.rv).items())
            if namespace is None or key[0] == namespace
        ]

    def put(self, obj: Mapping[str, Any]) -> Obj:
        """Create or replace an object as a controller or kubelet would (no checks): the test's way
        to set pod phases, node status, or seed state. Emits the watch event."""
        plural = self._plural_for(obj)
        kind = self.kind(plural)
        new = clone(obj)
        meta = new.setdefault("metadata", {})
        new["apiVersion"], new["kind"] = kind.api_version, kind.kind
        key = key_of(new)
        old = self.store.peek(kind, key)
        if old is None:
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", now())
            if kind.tracks_generation:
                meta.setdefault("generation", 1)
            return self.store.create(kind, new)
        for field in ("uid", "creationTimestamp", "generation"):
            if field in old["metadata"]:
                meta.setdefault(field, old["metadata"][field])
        return self.store.update(kind, new)

    def remove(self, plural: str, name: str, namespace: str | None = None) -> Obj:
        kind = self.kind(plural)
        return self.store.delete(kind, (namespace or "", name))

    def _plural_for(self, obj: Mapping[str, Any]) -> str:
        for kind in self._by_plural.values():
            if kind.kind == obj.get("kind") and kind.api_version == obj.get("apiVersion"):
                return kind.plural
        raise KeyError(f"the fake serves no {obj.get('apiVersion')}/{obj.get('kind')}")

    # --- HTTP ----------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        record = RequestRecord(
            request.method, request.path, dict(request.query), request.content_length or 0
        )
        self.requests.append(record)
        if self.on_request is not None:
            outcome = self.on_request(record)
            if inspect.isawaitable(outcome):
                await outcome
        if self.latency:
            await asyncio.sleep(self.latency)
        if self.write_latency and request.method in ("POST", "PUT", "PATCH", "DELETE"):
            await asyncio.sleep(self.write_latency)
        if self._down == "drop":
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=503)
        try:
            if self._down == "503":
                raise ApiError(
                    503, "ServiceUnavailable", "the fake API server is down (test fault)"
                )
            if request.headers.get("Authorization") != f"Bearer {self.token}":
                raise ApiError(401, "Unauthorized", "Unauthorized")
            return await self._dispatch(request)
        except ApiError as err:
            return web.json_response(err.status(), status=err.code)

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path == "/version":
            return web.json_response({"major": "1", "minor": "36", "gitVersion": "v1.36.2-fake"})
        segments = [s for s in path.split("/") if s]
        if segments == ["api"]:
            return web.json_response({"kind": "APIVersions", "versions": ["v1"]})
        if segments == ["apis"]:
            return web.json_response(self._group_list())
        if segments[:1] == ["api"] and len(segments) >= 2:
            group, version, rest = "", segments[1], segments[2:]
        elif segments[:1] == ["apis"] and len(segments) >= 3:
            group, version, rest = segments[1], segments[2], segments[3:]
        else:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if not rest:
            return web.json_response(self._resource_list(group, version))
        route = self._route(group, version, rest)
        return await self._serve(request, route)

    def _route(self, group: str, version: str, rest: list[str]) -> Route:
        missing = ApiError(404, "NotFound", "the server could not find the requested resource")
        namespace: str | None = None
        ns_subresource = len(rest) == 3 and rest[2] in ("status", "finalize")
        if rest[0] == "namespaces" and len(rest) >= 3 and not ns_subresource:
            namespace, rest = rest[1], rest[2:]
        if len(rest) > 3:
            raise missing
        kind = self._kinds.get((group, version, rest[0]))
        if kind is None:
            raise missing
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if namespace is not None and not kind.namespaced:
            raise missing
        if kind.namespaced and namespace is None and name is not None:
            raise missing
        if sub is not None and not (
            (sub == "status" and kind.status_subresource)
            or (sub == "binding" and kind is POD)
            or (sub == "token" and kind is SERVICE_ACCOUNT)
        ):
            raise missing
        return Route(kind, namespace, name, sub)

    async def _serve(self, request: web.Request, route: Route) -> web.StreamResponse:
        method = request.method
        if route.name is None:
            if method == "GET":
                if _truthy(request.query.get("watch")):
                    return await self._watch(request, route)
                return self._list(request, route)
            if method == "POST":
                if route.kind.namespaced and route.namespace is None:
                    raise ApiError(405, "MethodNotAllowed", "the server does not allow this method")
                return await self._create(request, route)
            if method == "DELETE":
                return await self._delete_collection(request, route)
        elif route.sub == "binding":
            if method == "POST":
                return await self._bind(request, route)
        elif route.sub == "token":
            if method == "POST":
                return self._token(route)
        elif method == "GET":
            return self._get(route)
        elif method == "PUT":
            return await self._replace(request, route)
        elif method == "PATCH":
            return await self._patch(request, route)
        elif method == "DELETE" and route.sub is None:
            return await self._delete(request, route)
        raise ApiError(405, "MethodNotAllowed", f"the server does not allow this method: {method}")

    # --- discovery -----------------------------------------------------------------------

    def _group_list(self) -> Obj:
        groups: dict[str, list[str]] = {}
        for kind in self._kinds.values():
            if kind.group:
                groups.setdefault(kind.group, [])
                if kind.version not in groups[kind.group]:
                    groups[kind.group].append(kind.version)
        return {
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [
                {
                    "name": group,
                    "versions": [{"groupVersion": f"{group}/{v}", "version": v} for v in versions],
                    "preferredVersion": {
                        "groupVersion": f"{group}/{versions[0]}",
                        "version": versions[0],
                    },
                }
                for group, versions in sorted(groups.items())
            ],
        }

    def _resource_list(self, group: str, version: str) -> Obj:
        kinds = [k for k in self._kinds.values() if (k.group, k.version) == (group, version)]
        if not kinds:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        resources: list[Obj] = []
        for kind in kinds:
            verbs = ["create", "delete", "deletecollection", "get", "list", "patch", "update"]
            resources.append(
                {
                    "name": kind.plural,
                    "singularName": kind.kind.lower(),
                    "namespaced": kind.namespaced,
                    "kind": kind.kind,
                    "verbs": [*verbs, "watch"],
                }
            )
            if kind.status_subresource:
                resources.append(
                    {
                        "name": f"{kind.plural}/status",
                        "singularName": "",
                        "namespaced": kind.namespaced,
                        "kind": kind.kind,
                        "verbs": ["get", "patch", "update"],
                    }
                )
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": kinds[0].api_version,
            "resources": resources,
        }

    # --- reads ---------------------------------------------------------------------------

    def _key(self, route: Route) -> Key:
        assert route.name is not None
        return (route.namespace or "", route.name)

    def _get(self, route: Route) -> web.Response:
        obj = self.store.get(route.kind, self._key(route))
        if obj is None:
            raise not_found(route.kind, route.name or "")
        return web.json_response(obj)

    def _matcher(self, request: web.Request, kind: Kind) -> Any:
        try:
            return compile_selectors(
                request.query.get("labelSelector", ""),
                request.query.get("fieldSelector", ""),
                kind.field_labels,
            )
        except SelectorError as err:
            raise bad_request(str(err)) from None

    def _list(self, request: web.Request, route: Route) -> web.Response:
        kind = route.kind
        query = request.query
        matches = self._matcher(request, kind)
        limit = self._int_param(query, "limit") or 0
        start: Key | None = None
        token = query.get("continue", "")
        if token:
            at, start = self._decode_continue(token)
        else:
            at = self._list_version(query)
        try:
            state = self.store.snapshot(kind, at)
        except TooOld:
            raise ApiError(
                410,
                "Expired",
                "The provided continue parameter is too old to display a consistent list result. "
                "You can start a new list without the continue parameter.",
            ) from None
        keys = sorted(
            k
            for k in state
            if (route.namespace is None or k[0] == route.namespace) and (start is None or k > start)
        )
        items: list[Obj] = []
        remaining = 0
        last: Key | None = None
        for index, key in enumerate(keys):
            obj = state[key]
            if not matches(obj):
                continue
            if limit and len(items) == limit:
                remaining = sum(1 for k in keys[index:] if matches(state[k]))
                break
            items.append(self._list_item(kind, obj))
            last = key
        metadata: Obj = {"resourceVersion": str(at)}
        if remaining and last is not None:
            metadata["continue"] = self._encode_continue(at, last)
            if not query.get("labelSelector") and not query.get("fieldSelector"):
                metadata["remainingItemCount"] = remaining
        return web.json_response(
            {
                "kind": f"{kind.kind}List",
                "apiVersion": kind.api_version,
                "metadata": metadata,
                "items": items,
            }
        )

    def _list_item(self, kind: Kind, obj: Obj) -> Obj:
        """Items of built-in lists carry no kind/apiVersion on the wire; custom ones do."""
        item = clone(obj)
        if not kind.custom:
            item.pop("kind", None)
            item.pop("apiVersion", None)
        return item

    def _list_version(self, query: Mapping[str, str]) -> int:
        text = query.get("resourceVersion", "")
        match = query.get("resourceVersionMatch", "")
        if match and not text:
            raise bad_request(
                "resourceVersionMatch is forbidden unless resourceVersion is provided"
            )
        if text in ("", "0"):
            if match == "Exact" and text == "0":
                raise bad_request(
                    'resourceVersionMatch "Exact" is forbidden for resourceVersion "0"'
                )
            return self.store.rv
        rv = self._parse_rv(text)
        if match == "Exact":
            return rv
        if match not in ("", "NotOlderThan"):
            raise bad_request(f"resourceVersionMatch: Unsupported value: {match!r}")
        if rv > self.store.rv:
            raise self._too_large(rv)
        return self.store.rv

    def _too_large(self, rv: int) -> ApiError:
        """A version the server has not reached (the real one waits ~3 s for it first)."""
        return ApiError(
            504,
            "Timeout",
            f"Too large resource version: {rv}, current: {self.store.rv}",
            {
                "causes": [
                    {"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}
                ],
                "retryAfterSeconds": 1,
            },
        )

    @staticmethod
    def _parse_rv(text: str) -> int:
        try:
            rv = int(text)
        except ValueError:
            raise bad_request(f"invalid resource version: {text!r}") from None
        if rv < 0:
            raise bad_request(f"invalid resource version: {text!r}")
        return rv

    @staticmethod
    def _int_param(query: Mapping[str, str], name: str) -> int | None:
        text = query.get(name)
        if text is None or text == "":
            return None
        try:
            return int(text)
        except ValueError:
            raise bad_request(f"{name}: invalid integer {text!r}") from None

    @staticmethod
    def _encode_continue(rv: int, key: Key) -> str:
        raw = json.dumps({"v": "fake", "rv": rv, "start": list(key)}).encode()
        return base64.urlsafe_b64encode(raw).decode()

    @staticmethod
    def _decode_continue(token: str) -> tuple[int, Key]:
        try:
            data = json.loads(base64.urlsafe_b64decode(token.encode()))
            ns, name = data["start"]
            return int(data["rv"]), (str(ns), str(name))
        except (ValueError, KeyError, TypeError, binascii.Error):
            raise bad_request(f"continue key is not valid: {token!r}") from None

    # --- watch ---------------------------------------------------------------------------

    async def _watch(self, request: web.Request, route: Route) -> web.StreamResponse:
        kind = route.kind
        query = request.query
        matches = self._matcher(request, kind)
        timeout = self._int_param(query, "timeoutSeconds")
        watcher = Watcher(kind, route.namespace, matches, _truthy(query.get("allowWatchBookmarks")))
        text = query.get("resourceVersion", "")
        initial: list[tuple[str, Obj]] = []
        expired: TooOld | None = None
        if text in ("", "0"):
            state = self.store.snapshot(kind, self.store.rv)
            for key in sorted(state):
                if (route.namespace is None or key[0] == route.namespace) and matches(state[key]):
                    initial.append(("ADDED", state[key]))
        else:
            since = self._parse_rv(text)
            if since > self.store.rv:
                raise self._too_large(since)
            try:
                for change in self.store.changes_since(since):
                    event = watcher.translate(change)
                    if event is not None:
                        initial.append(event)
            except TooOld as err:
                expired = err
        # Subscribing in the same synchronous step as the replay: no change can slip between.
        if expired is None:
            self.store.subscribe(watcher)
            self._watch_opened.set()
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        try:
            await response.prepare(request)
            if expired is not None:
                error = ApiError(410, "Expired", str(expired))
                await self._send(response, "ERROR", error.status())
                await response.write_eof()
                return response
            for event_type, obj in initial:
                await self._send(response, event_type, obj)
            if await self._stream(request, response, watcher, timeout):
                await response.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the client went away
        finally:
            self.store.unsubscribe(watcher)
        return response

    async def _stream(
        self,
        request: web.Request,
        response: web.StreamResponse,
        watcher: Watcher,
        timeout_s: int | None,
    ) -> bool:
        """Pump the watcher's queue; True when the stream ends cleanly, False when dropped."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s if timeout_s else None
        next_bookmark = loop.time() + self.bookmark_interval if watcher.bookmarks else None
        while True:
            wake = min((t for t in (deadline, next_bookmark) if t is not None), default=None)
            try:
                if wake is None:
                    item = await watcher.queue.get()
                else:
                    item = await asyncio.wait_for(watcher.queue.get(), max(0.0, wake - loop.time()))
            except TimeoutError:
                now = loop.time()
                if deadline is not None and now >= deadline:
                    return True
                if watcher.queue.empty():
                    # Every change up to the head has been sent or filtered out: safe to bookmark.
                    item = Bookmark(self.store.rv)
                    next_bookmark = now + self.bookmark_interval
                else:
                    item = watcher.queue.get_nowait()
            if isinstance(item, Close):
                if item.abort:
                    if request.transport is not None:
                        request.transport.abort()
                    return False
                return True
            if isinstance(item, Bookmark):
                bookmark = {
                    "kind": watcher.kind.kind,
                    "apiVersion": watcher.kind.api_version,
                    "metadata": {"resourceVersion": str(item.rv)},
                }
                await self._send(response, "BOOKMARK", bookmark)
                continue
            assert isinstance(item, Change)
            event = watcher.translate(item)
            if event is not None:
                await self._send(response, *event)

    @staticmethod
    async def _send(response: web.StreamResponse, event_type: str, obj: Mapping[str, Any]) -> None:
        line = json.dumps({"type": event_type, "object": obj}, separators=(",", ":")) + "\n"
        await response.write(line.encode())

    # --- bodies and checks ---------------------------------------------------------------

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        if not raw:
            return None
        content_type = request.headers.get("Content-Type", "application/json").split(";")[0].strip()
        if content_type == "application/yaml":
            try:
                return yaml.safe_load(raw)
            except yaml.YAMLError as err:
                raise bad_request(f"couldn't get version/kind; yaml parse error: {err}") from None
        if "json" not in content_type:
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f'the body of the request was in an unknown format ("{content_type}"); '
                "accepted media types include: application/json, application/yaml, "
                "application/json-patch+json, application/merge-patch+json, "
                "application/strategic-merge-patch+json (server-side apply is not modelled)",
            )
        try:
            return json.loads(raw)
        except ValueError as err:
            raise bad_request(f"couldn't get version/kind; json parse error: {err}") from None

    @staticmethod
    def _dry_run(request: web.Request) -> bool:
        values = request.query.getall("dryRun", [])
        for value in values:
            if value != "All":
                raise bad_request(f'dryRun: Unsupported value: "{value}": supported values: "All"')
        return bool(values)

    def _check_body(self, route: Route, body: Any, *, require_type: bool) -> tuple[Obj, list[str]]:
        """Type, identity and pruning checks shared by create and replace: 400s for what the
        server cannot decode; unknown top-level fields dropped with a warning."""
        kind = route.kind
        if not isinstance(body, dict):
            raise bad_request(
                f"the request body for {kind.resource} must be a JSON object, "
                f"got {type(body).__name__}"
            )
        obj = clone(body)
        api_version, kind_name = obj.get("apiVersion"), obj.get("kind")
        if require_type and kind.custom and (not api_version or not kind_name):
            raise bad_request(f"Object 'Kind' is missing in '{json.dumps(body)[:200]}'")
        if api_version and api_version != kind.api_version:
            raise bad_request(
                f"the API version in the data ({api_version}) does not match the expected "
                f"API version ({kind.api_version})"
            )
        if kind_name and kind_name != kind.kind:
            raise bad_request(
                f"the kind in the data ({kind_name}) does not match the expected kind "
                f"({kind.kind}) for {kind.resource}"
            )
        obj["apiVersion"], obj["kind"] = kind.api_version, kind.kind
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise bad_request("metadata must be a JSON object")
        if kind.namespaced:
            body_ns = meta.get("namespace")
            if body_ns and body_ns != route.namespace:
                raise bad_request(
                    "the namespace of the provided object does not match the namespace sent on "
                    f"the request (object: {body_ns!r}, URL: {route.namespace!r})"
                )
            meta["namespace"] = route.namespace
        else:
            meta.pop("namespace", None)
        unknown = sorted(set(obj) - kind.allowed_top_fields)
        return obj, unknown

    def _prune(self, request: web.Request, obj: Obj, unknown: list[str]) -> dict[str, str]:
        if not unknown:
            return {}
        validation = request.query.get("fieldValidation", "Warn")
        if validation == "Strict":
            text = ", ".join(f'unknown field "{f}"' for f in unknown)
            raise bad_request(f"strict decoding error: {text}")
        for field in unknown:
            obj.pop(field, None)
        if validation == "Ignore":
            return {}
        warning = ", ".join(f'299 - "unknown field \\"{f}\\""' for f in unknown)
        return {"Warning": warning}

    def _namespace_usable(self, route: Route) -> None:
        if not route.kind.namespaced:
            return
        ns = self.store.peek(NAMESPACE, ("", route.namespace or ""))
        if ns is None:
            raise not_found(NAMESPACE, route.namespace or "")
        if ns["metadata"].get("deletionTimestamp"):
            raise ApiError(
                403,
                "Forbidden",
                f"{route.kind.resource} is forbidden: unable to create new content in namespace "
                f"{route.namespace} because it is being terminated",
            )

    def _take_forced(self, kind: Kind, key: Key) -> None:
        forced = self._forced.get((kind, key))
        if forced is None:
            return
        forced.remaining -= 1
        if forced.remaining <= 0:
            del self._forced[(kind, key)]
        if forced.code == 409:
            raise conflict(kind, key[1], STALE)
        raise ApiError(forced.code, "InternalError", f"injected failure {forced.code} (test fault)")

    # --- create --------------------------------------------------------------------------

    async def _create(self, request: web.Request, route: Route) -> web.Response:
        kind = route.kind
        dry_run = self._dry_run(request)
        obj, unknown = self._check_body(route, await self._body(request), require_type=True)
        headers = self._prune(request, obj, unknown)
        meta = obj["metadata"]
        if meta.get("resourceVersion"):
            raise bad_request("resourceVersion should not be set on objects to be created")
        if not meta.get("name"):
            prefix = meta.get("generateName")
            if not prefix:
                raise invalid(
                    kind,
                    "",
                    [("metadata.name", "Required value: name or generateName is required")],
                )
            suffix = "".join(secrets.choice(GENERATE_ALPHABET) for _ in range(5))
            meta["name"] = f"{prefix}{suffix}"
        validate(kind, obj)
        self._namespace_usable(route)
        key = key_of(obj)
        if self.store.peek(kind, key) is not None:
            details = {"name": meta["name"], "kind": kind.plural}
            if kind.group:
                details["group"] = kind.group
            raise ApiError(
                409, "AlreadyExists", f'{kind.resource} "{meta["name"]}" already exists', details
            )
        for server_owned in ("uid", "deletionTimestamp", "deletionGracePeriodSeconds", "selfLink"):
            meta.pop(server_owned, None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now()
        if kind.tracks_generation:
            meta["generation"] = 1
        defaults_on_create(kind, obj)
        fold_secret_data(kind, obj)
        rewrite(kind, obj)
        if dry_run:
            return web.json_response(obj, status=201, headers=headers)
        return web.json_response(self.store.create(kind, obj), status=201, headers=headers)

    # --- update --------------------------------------------------------------------------

    async def _replace(self, request: web.Request, route: Route) -> web.Response:
        obj, unknown = self._check_body(route, await self._body(request), require_type=True)
        headers = self._prune(request, obj, unknown)
        result = self._update(route, obj, self._dry_run(request), require_rv=route.kind.custom)
        return web.json_response(result, headers=headers)

    async def _patch(self, request: web.Request, route: Route) -> web.Response:
        kind = route.kind
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        patch = await self._body(request)
        old = self.store.get(kind, self._key(route))
        if old is None:
            raise not_found(kind, route.name or "")
        patched = apply_patch(kind, content_type, old, patch)
        if not isinstance(patched, dict):
            raise ApiError(422, "Invalid", "the patched object is not a JSON object")
        obj, unknown = self._check_body(route, patched, require_type=False)
        headers = self._prune(request, obj, unknown)
        result = self._update(route, obj, self._dry_run(request), require_rv=False)
        return web.json_response(result, headers=headers)

    def _update(self, route: Route, new: Obj, dry_run: bool, *, require_rv: bool) -> Obj:
        """The shared update path (PUT, PATCH, /status): preconditions, subresource rules,
        immutability, generation, finalizers, and no-op detection."""
        kind = route.kind
        key = self._key(route)
        meta = new["metadata"]
        if meta.get("name") and meta["name"] != key[1]:
            raise bad_request(
                f"the name of the object ({meta['name']}) does not match the name on the URL "
                f"({key[1]})"
            )
        old = self.store.get(kind, key)
        if old is None:
            raise not_found(kind, key[1])
        self._take_forced(kind, key)
        old_meta = old["metadata"]
        rv = meta.get("resourceVersion")
        if not rv:
            if require_rv:
                raise invalid(
                    kind,
                    key[1],
                    [
                        (
                            "metadata.resourceVersion",
                            "Invalid value: 0x0: must be specified for an update",
                        )
                    ],
                )
        elif str(rv) != old_meta["resourceVersion"]:
            raise conflict(kind, key[1], STALE)
        if meta.get("uid") and meta["uid"] != old_meta["uid"]:
            raise conflict(
                kind,
                key[1],
                f"Precondition failed: UID in precondition: {meta['uid']}, UID in object meta: "
                f"{old_meta['uid']}",
            )
        if route.sub == "status":
            result = clone(old)
            if "status" in new:
                result["status"] = new["status"]
            else:
                result.pop("status", None)
        else:
            result = new
            if kind.status_subresource:
                if "status" in old:
                    result["status"] = old["status"]
                else:
                    result.pop("status", None)
        result_meta = result["metadata"]
        result_meta["name"] = key[1]
        for server_owned in (
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
            "resourceVersion",
        ):
            if server_owned in old_meta:
                result_meta[server_owned] = old_meta[server_owned]
            else:
                result_meta.pop(server_owned, None)
        validate(kind, result)
        fold_secret_data(kind, result)
        rewrite(kind, result)
        check_immutable(kind, old, result)
        if kind.tracks_generation and _content_outside(
            result, "metadata", "status"
        ) != _content_outside(old, "metadata", "status"):
            result_meta["generation"] = int(old_meta.get("generation", 1)) + 1
        if result == old:
            return old
        if (
            result_meta.get("deletionTimestamp")
            and result_meta.get("deletionGracePeriodSeconds") == 0
            and not result_meta.get("finalizers")
        ):
            # The last finalizer of an object whose deletion is due: the real store deletes it in
            # the same transaction, so watchers see one DELETED event. (A pod still within its
            # grace period stays until deleted again.)
            if dry_run:
                return result
            return self.store.delete(kind, key, final=result)
        if dry_run:
            return result
        return self.store.update(kind, result)

    def _token(self, route: Route) -> web.Response:
        """TokenRequest: the fake has one identity, so every account's token is its token."""
        if self.store.get(SERVICE_ACCOUNT, self._key(route)) is None:
            raise not_found(SERVICE_ACCOUNT, route.name or "")
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "status": {"token": self.token, "expirationTimestamp": "2099-01-01T00:00:00Z"},
        }
        return web.json_response(body, status=201)

    async def _bind(self, request: web.Request, route: Route) -> web.Response:
        body = await self._body(request)
        target = (body or {}).get("target") or {} if isinstance(body, dict) else {}
        node = target.get("name") if isinstance(target, dict) else None
        if not node:
            raise invalid(POD, route.name or "", [("target.name", "Required value")])
        key = self._key(route)
        pod = self.store.get(POD, key)
        if pod is None:
            raise not_found(POD, key[1])
        meta = (body or {}).get("metadata") if isinstance(body, dict) else None
        meta = meta if isinstance(meta, dict) else {}
        uid = meta.get("uid")
        if uid and uid != pod["metadata"].get("uid"):
            # The Binding's UID is a storage precondition (kubernetes#105913): a Binding for an
            # earlier pod of the same name never lands on its successor.
            message = (
                f"Precondition failed: UID in precondition: {uid}, "
                f"UID in object meta: {pod['metadata'].get('uid')}"
            )
            raise conflict(POD, key[1], message)
        current = (pod.get("spec") or {}).get("nodeName")
        if current:
            raise conflict(POD, key[1], f'pod {key[1]} is already assigned to node "{current}"')
        if not self._dry_run(request):
            pod["spec"]["nodeName"] = node
            # The real server merges the Binding's annotations into the pod in the same update
            # that sets spec.nodeName (setPodNodeAndMetadata).
            annotations = meta.get("annotations")
            if isinstance(annotations, dict) and annotations:
                merged = {**(pod["metadata"].get("annotations") or {}), **annotations}
                pod["metadata"]["annotations"] = merged
            self.store.update(POD, pod)
        return web.json_response(
            {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Success",
                "code": 201,
            },
            status=201,
        )

    # --- delete --------------------------------------------------------------------------

    async def _delete(self, request: web.Request, route: Route) -> web.Response:
        body = await self._body(request)
        options = body if isinstance(body, dict) else {}
        dry_run = self._dry_run(request) or options.get("dryRun") == ["All"]
        grace = self._int_param(request.query, "gracePeriodSeconds")
        if grace is not None:
            options = {**options, "gracePeriodSeconds": grace}
        result = self._delete_one(route.kind, self._key(route), options, dry_run)
        return web.json_response(result)

    def _delete_one(self, kind: Kind, key: Key, options: Mapping[str, Any], dry_run: bool) -> Obj:
        old = self.store.get(kind, key)
        if old is None:
            raise not_found(kind, key[1])
        self._take_forced(kind, key)
        preconditions = options.get("preconditions") or {}
        meta = old["metadata"]
        want_rv = preconditions.get("resourceVersion")
        if want_rv and want_rv != meta["resourceVersion"]:
            raise conflict(
                kind,
                key[1],
                f"Precondition failed: ResourceVersion in precondition: {want_rv}, "
                f"ResourceVersion in object meta: {meta['resourceVersion']}",
            )
        want_uid = preconditions.get("uid")
        if want_uid and want_uid != meta["uid"]:
            raise conflict(
                kind,
                key[1],
                f"Precondition failed: UID in precondition: {want_uid}, UID in object meta: "
                f"{meta['uid']}",
            )
        if dry_run:
            return self._deleted_body(kind, old)
        grace = self._grace_period(kind, old, options)
        if grace > 0:
            current = meta.get("deletionGracePeriodSeconds")
            if meta.get("deletionTimestamp") and current is not None and current <= grace:
                return old  # already terminating at least this soon
            meta["deletionTimestamp"] = now(grace)
            meta["deletionGracePeriodSeconds"] = grace
            return self.store.update(kind, old)
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp") or meta.get("deletionGracePeriodSeconds") != 0:
                meta.setdefault("deletionTimestamp", now())
                meta["deletionGracePeriodSeconds"] = 0
                old = self.store.update(kind, old)
            return old
        if kind is NAMESPACE:
            for other in self._by_plural.values():
                if other.namespaced:
                    for other_key in self.store.keys(other):
                        if other_key[0] == key[1]:
                            self.store.delete(other, other_key)
        return self._deleted_body(kind, self.store.delete(kind, key))

    def _grace_period(self, kind: Kind, obj: Obj, options: Mapping[str, Any]) -> int:
        """Seconds a pod deletion waits for its kubelet (only with graceful_pod_deletion): pods
        never bound to a node or already finished go at once, as on the real server."""
        if not (self.graceful_pod_deletion and kind is POD):
            return 0
        spec = obj.get("spec") or {}
        if not spec.get("nodeName"):
            return 0
        if (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            return 0
        requested = options.get("gracePeriodSeconds")
        grace = requested if requested is not None else spec.get("terminationGracePeriodSeconds")
        return max(0, int(30 if grace is None else grace))

    @staticmethod
    def _deleted_body(kind: Kind, obj: Obj) -> Obj:
        if kind.returns_deleted_object:
            return obj
        details: Obj = {
            "name": obj["metadata"]["name"],
            "kind": kind.plural,
            "uid": obj["metadata"]["uid"],
        }
        if kind.group:
            details["group"] = kind.group
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "details": details,
        }

    async def _delete_collection(self, request: web.Request, route: Route) -> web.Response:
        body = await self._body(request)
        options = body if isinstance(body, dict) else {}
        dry_run = self._dry_run(request)
        matches = self._matcher(request, route.kind)
        state = self.store.snapshot(route.kind, self.store.rv)
        deleted: list[Obj] = []
        for key in sorted(state):
            if (route.namespace is None or key[0] == route.namespace) and matches(state[key]):
                deleted.append(self._delete_one(route.kind, key, options, dry_run))
        return web.json_response(
            {
                "kind": f"{route.kind.kind}List",
                "apiVersion": route.kind.api_version,
                "metadata": {"resourceVersion": str(self.store.rv)},
                "items": deleted,
            }
        )


async def _serve_forever(kubeconfig: Path) -> None:
    async with FakeApiServer() as fake:
        fake.kubeconfig(kubeconfig)
        print(f"fake API server on {fake.url}; kubeconfig written to {kubeconfig}", flush=True)
        await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    """`python -m testkit.apiserver --kubeconfig PATH`: serve until interrupted (for trying
    a component, or the e2e scaffolding, against the fake from another process)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m testkit.apiserver")
    parser.add_argument("--kubeconfig", type=Path, required=True, help="where to write it")
    args = parser.parse_args(argv)
    with suppress(KeyboardInterrupt):
        asyncio.run(_serve_forever(args.kubeconfig))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
