"""How fracgpu's components talk to Kubernetes: a client factory, raw JSON calls, and an informer.

Objects stay plain dicts with the field names as on the wire (`metadata.resourceVersion`), read
as raw JSON (`_preload_content=False`): faster than kubernetes-asyncio's model classes, and the
same shape the admission webhook receives.

The informer follows the loop that survives real API servers (design K6; kubernetes-asyncio's
`watch.Watch` does not relist on 410 and so cannot be used for this):

1. list, paginated (`limit`/`continue`), and take the list's resourceVersion;
2. rebuild the cache from scratch, emitting synthetic DELETED events for objects that vanished
   while we were not watching (and ADDED/MODIFIED for what appeared or changed);
3. watch from that version with `allowWatchBookmarks=true` and a jittered `timeoutSeconds`;
4. advance the version on every event, bookmarks included;
5. when the watch ends cleanly, watch again from the version reached;
6. on 410 Gone (HTTP status or an ERROR event in the stream), or an expired `continue`: relist;
7. on any other failure (connection refused or dropped, 5xx, timeouts): back off with jitter,
   then watch again from the version reached (a version that has meanwhile been compacted gets a
   410 and so a relist).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypedDict, cast

import aiohttp
import aiohttp.helpers
import yarl
from kubernetes_asyncio import config as kube_config
from kubernetes_asyncio.client import ApiClient, Configuration
from prometheus_client import CollectorRegistry, Counter, Gauge

from core.units import DOMAIN

log = logging.getLogger(__name__)

Obj = dict[str, Any]
"""A JSON object as the API server sends it (a list, a Status, an object of any kind)."""


class RawMeta(TypedDict, total=False):
    """The ``metadata`` fields fracgpu reads. Objects stay plain dicts (unknown fields are kept,
    never dropped); these types only let the checker catch a misspelt key."""

    name: str
    generateName: str
    namespace: str
    uid: str
    resourceVersion: str
    generation: int
    labels: dict[str, str]
    annotations: dict[str, str]
    ownerReferences: list[dict[str, Any]]
    deletionTimestamp: str
    creationTimestamp: str


class RawBody(TypedDict, total=False):
    """One Kubernetes object as fracgpu reads it: a Pod, a Node, a GPUQuota, a Secret…"""

    apiVersion: str
    kind: str
    metadata: RawMeta
    spec: dict[str, Any]
    status: dict[str, Any]
    data: dict[str, str]


Key = tuple[str, str]  # (namespace or "", name)
EventType = Literal["ADDED", "MODIFIED", "DELETED"]
Handler = Callable[[EventType, RawBody], Awaitable[None] | None]
Api = ApiClient
"""The client every component uses, made by :func:`kube_client` (kubernetes-asyncio ships no types,
so this alias names the intent where ``Any`` would not)."""


class KubeConfigError(RuntimeError):
    """No way to reach a cluster was configured."""


class KubeError(Exception):
    """The API server answered with a failure `Status` (or something that is not JSON)."""

    def __init__(self, status: int, reason: str, message: str, body: Obj | None = None) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.body = body or {}


class KubeNotFound(KubeError):
    """404: the object (or its kind: a CRD that is not installed) does not exist."""


class KubeConflict(KubeError):
    """409: the object changed since it was read, or already exists; re-read and retry."""


class KubeGone(KubeError):
    """410: the resourceVersion or continue token was compacted away; only a fresh list helps."""


class KubeInvalid(KubeError):
    """422: the API server's validation refused the object; the message says which field."""


_BY_CODE: dict[int, type[KubeError]] = {
    404: KubeNotFound,
    409: KubeConflict,
    410: KubeGone,
    422: KubeInvalid,
}


def status_error(status: int, body: Mapping[str, Any] | None, raw: bytes = b"") -> KubeError:
    """The typed error for an HTTP failure or a watch ERROR event (one parser for both).

    A ``Status`` body's own ``code`` wins over the HTTP status: a watch stream reports failures
    inside an HTTP 200.
    """
    if isinstance(body, Mapping) and body.get("kind", "Status") == "Status" and body:
        code = int(body.get("code") or status)
        reason, message = str(body.get("reason") or ""), str(body.get("message") or "")
        return _BY_CODE.get(code, KubeError)(code, reason, message, dict(body))
    return _BY_CODE.get(status, KubeError)(status, "Unknown", raw[:200].decode("utf-8", "replace"))


# --- client factory ---------------------------------------------------------------------------


async def load_configuration(
    kubeconfig: Path | str | None = None, context: str | None = None
) -> Any:
    """A kubernetes-asyncio Configuration, from the first source that exists:
    the given kubeconfig path; in-cluster (service account); $KUBECONFIG; ~/.kube/config."""
    configuration = Configuration()
    path = _kubeconfig_path(kubeconfig)
    if path is None:
        load_incluster: Any = kube_config.load_incluster_config  # untyped upstream
        load_incluster(client_configuration=configuration)
        return configuration
    await kube_config.load_kube_config(
        config_file=str(path),
        context=context,
        client_configuration=configuration,
        persist_config=False,
    )
    return configuration


def _kubeconfig_path(kubeconfig: Path | str | None) -> Path | None:
    """The kubeconfig to read, or None for in-cluster configuration."""
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        return None
    candidates: list[Path] = []
    if kubeconfig is not None:
        candidates.append(Path(kubeconfig))
    else:
        env = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
        candidates += [Path(env)] if env else []
        candidates.append(Path("~/.kube/config").expanduser())
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    if kubeconfig is not None:
        raise KubeConfigError(
            f"kubeconfig {str(kubeconfig)!r} does not exist; pass an existing path"
        )
    env_text = os.environ.get("KUBECONFIG")
    env_note = f"KUBECONFIG={env_text!r} names no file" if env_text else "KUBECONFIG unset"
    raise KubeConfigError(
        "no Kubernetes configuration: not running in a pod (KUBERNETES_SERVICE_HOST unset), "
        f"no kubeconfig given, {env_note} and ~/.kube/config absent; pass a kubeconfig "
        "path or run in-cluster"
    )


def api_client(configuration: Configuration) -> Any:
    """An ApiClient whose requests do not each look up the environment.

    kubernetes-asyncio opens its aiohttp session with ``trust_env=True``, which makes every
    request read the proxy variables and ``~/.netrc`` in a worker thread: two thread hand-offs
    per API call, on the path of every quota decision. The proxy is resolved here once instead
    (``HTTPS_PROXY``/``NO_PROXY``, as client-go honours them; a proxy in the kubeconfig wins),
    and netrc, which Kubernetes clients do not use, not at all.
    """
    client = ApiClient(configuration=configuration)
    rest = client.rest_client
    if not rest.proxy and configuration.host:
        with suppress(LookupError, ValueError):
            proxy, auth = aiohttp.helpers.get_env_proxy_for_url(yarl.URL(configuration.host))
            rest.proxy = str(proxy)
            if auth is not None:
                rest.proxy_headers = {"Proxy-Authorization": auth.encode()}
    env_session = rest.pool_manager
    rest.pool_manager = aiohttp.ClientSession(
        connector=env_session.connector,
        trust_env=False,
        read_bufsize=2**21,  # as kubernetes-asyncio: watch events of large objects
    )
    env_session.detach()  # the connector now belongs to the new session
    return client


@asynccontextmanager
async def kube_client(
    kubeconfig: Path | str | None = None, context: str | None = None
) -> AsyncIterator[Any]:
    """`async with kube_client(path) as api:` an ApiClient, closed (connections too) on exit."""
    configuration = await load_configuration(kubeconfig, context)
    client = api_client(configuration)
    try:
        yield client
    finally:
        await client.close()


# --- raw calls --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Resource:
    """Where a kind lives on the API server."""

    group: str  # "" for the core group
    version: str
    plural: str
    namespaced: bool

    def path(self, namespace: str | None = None, name: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace is not None:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        return base if name is None else f"{base}/{name}"


PODS = Resource("", "v1", "pods", namespaced=True)
NODES = Resource("", "v1", "nodes", namespaced=False)
NAMESPACES = Resource("", "v1", "namespaces", namespaced=False)
SECRETS = Resource("", "v1", "secrets", namespaced=True)
EVENTS = Resource("", "v1", "events", namespaced=True)
LEASES = Resource("coordination.k8s.io", "v1", "leases", namespaced=True)
MUTATING_WEBHOOK_CONFIGURATIONS = Resource(
    "admissionregistration.k8s.io", "v1", "mutatingwebhookconfigurations", namespaced=False
)
VALIDATING_WEBHOOK_CONFIGURATIONS = Resource(
    "admissionregistration.k8s.io", "v1", "validatingwebhookconfigurations", namespaced=False
)
GPUQUOTAS = Resource(DOMAIN, "v1", "gpuquotas", namespaced=True)
DEPLOYMENTS = Resource("apps", "v1", "deployments", namespaced=True)
REPLICASETS = Resource("apps", "v1", "replicasets", namespaced=True)
STATEFULSETS = Resource("apps", "v1", "statefulsets", namespaced=True)
DAEMONSETS = Resource("apps", "v1", "daemonsets", namespaced=True)
JOBS = Resource("batch", "v1", "jobs", namespaced=True)
CRONJOBS = Resource("batch", "v1", "cronjobs", namespaced=True)
# Dynamic resource allocation (DRA mode), served by default from Kubernetes 1.34 on.
RESOURCE_SLICES = Resource("resource.k8s.io", "v1", "resourceslices", namespaced=False)
RESOURCE_CLAIMS = Resource("resource.k8s.io", "v1", "resourceclaims", namespaced=True)
RESOURCE_CLAIM_TEMPLATES = Resource(
    "resource.k8s.io", "v1", "resourceclaimtemplates", namespaced=True
)
DEVICE_CLASSES = Resource("resource.k8s.io", "v1", "deviceclasses", namespaced=False)


async def open_request(
    api: Api,
    method: str,
    path: str,
    *,
    query: Sequence[tuple[str, str]] = (),
    body: Any = None,
    content_type: str = "application/json",
    timeout_s: tuple[float, float] | float | None = 30.0,
) -> aiohttp.ClientResponse:
    """Send a request through the ApiClient (its auth, TLS and connection pool) and return the
    raw response unread. Raises KubeError for a non-2xx answer."""
    response: aiohttp.ClientResponse = await api.call_api(
        path,
        method,
        query_params=list(query),
        header_params={"Accept": "application/json", "Content-Type": content_type},
        body=body,
        auth_settings=["BearerToken"],
        _preload_content=False,
        _request_timeout=_client_timeout(timeout_s),
    )
    if not 200 <= response.status < 300:
        raw = await response.read()
        response.release()
        raise _error(response.status, raw)
    return response


async def call_json(
    api: Api,
    method: str,
    path: str,
    *,
    query: Sequence[tuple[str, str]] = (),
    body: Any = None,
    content_type: str = "application/json",
    timeout_s: float = 30.0,
) -> Obj:
    """One request, its JSON answer as a dict. Raises KubeError for a failure."""
    response = await open_request(
        api, method, path, query=query, body=body, content_type=content_type, timeout_s=timeout_s
    )
    try:
        raw = await response.read()
    finally:
        response.release()
    try:
        data = json.loads(raw)
    except ValueError:
        raise KubeError(response.status, "BadResponse", f"not JSON: {raw[:200]!r}") from None
    if not isinstance(data, dict):
        raise KubeError(response.status, "BadResponse", f"not a JSON object: {raw[:200]!r}")
    return data


def _client_timeout(timeout_s: float | tuple[float, float] | None) -> aiohttp.ClientTimeout | None:
    """A total timeout, or (connect, read) for streams that may run long but must not go quiet."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, tuple):
        connect, read = timeout_s
        return aiohttp.ClientTimeout(connect=connect, sock_connect=connect, sock_read=read)
    return aiohttp.ClientTimeout(total=timeout_s)


def _error(status: int, raw: bytes) -> KubeError:
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("kind") == "Status":
        return status_error(status, body)
    return status_error(status, None, raw)


def object_key(obj: Mapping[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))


# --- informer ---------------------------------------------------------------------------------


@dataclass
class InformerStats:
    """Counters for metrics and tests: how often each recovery path ran."""

    lists: int = 0
    relists_410: int = 0
    watches: int = 0
    bookmarks: int = 0
    events: int = 0
    errors: int = 0
    handler_errors: int = 0


class InformerMetrics:
    """Prometheus series for any number of informers (label `informer`) in a given registry."""

    def __init__(self, registry: CollectorRegistry, prefix: str = "fracgpu_informer") -> None:
        self.lists = Counter(
            f"{prefix}_lists",
            "Complete lists (the initial one and every relist)",
            ["informer"],
            registry=registry,
        )
        self.relists_410 = Counter(
            f"{prefix}_relists_410",
            "Relists forced by 410 Gone (history compacted)",
            ["informer"],
            registry=registry,
        )
        self.errors = Counter(
            f"{prefix}_errors",
            "Failed list or watch requests (retried with backoff)",
            ["informer"],
            registry=registry,
        )
        self.events = Counter(
            f"{prefix}_events",
            "Changes delivered to handlers, synthetic ones included",
            ["informer", "type"],
            registry=registry,
        )
        self.objects = Gauge(
            f"{prefix}_objects", "Objects in the cache", ["informer"], registry=registry
        )
        self.synced = Gauge(
            f"{prefix}_synced",
            "1 once the first list has been delivered",
            ["informer"],
            registry=registry,
        )


@dataclass
class _Subscription:
    queue: asyncio.Queue[tuple[EventType, RawBody]] = field(default_factory=asyncio.Queue)


class Informer:
    """A cache of one kind's objects kept current by list + watch; see the module docstring.

    Use `async with Informer(api, NODES, handler=...) as informer:` (or `start()`/`stop()`),
    then `await informer.wait_synced()`. Handlers (plain or async functions of
    `(event_type, obj)`) and `events()` iterators see every change in order, synthetic deletes
    after a relist included. A failing handler is logged and does not stop the informer.
    """

    def __init__(
        self,
        api: Api,
        resource: Resource,
        *,
        namespace: str | None = None,
        label_selector: str = "",
        field_selector: str = "",
        handler: Handler | None = None,
        page_size: int = 500,
        watch_timeout_s: float = 300.0,
        request_timeout_s: float = 30.0,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        name: str | None = None,
        metrics: InformerMetrics | None = None,
    ) -> None:
        self.api = api
        self.metrics = metrics
        self.resource = resource
        self.namespace = namespace
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.page_size = page_size
        self.watch_timeout_s = watch_timeout_s
        self.request_timeout_s = request_timeout_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.name = name or resource.plural
        self.resource_version = ""
        self.synced = asyncio.Event()
        self.stats = InformerStats()
        self._cache: dict[Key, RawBody] = {}
        self._handlers: list[Handler] = [handler] if handler else []
        self._subscriptions: list[_Subscription] = []
        self._task: asyncio.Task[None] | None = None

    # --- reading the cache ---

    @property
    def has_synced(self) -> bool:
        return self.synced.is_set()

    def get(self, name: str, namespace: str | None = None) -> RawBody | None:
        return self._cache.get((namespace or "", name))

    def objects(self, namespace: str | None = None) -> list[RawBody]:
        return [o for k, o in self._cache.items() if namespace is None or k[0] == namespace]

    def __len__(self) -> int:
        return len(self._cache)

    async def wait_synced(self, within_s: float | None = None) -> None:
        await asyncio.wait_for(self.synced.wait(), within_s)

    # --- consumers ---

    def add_handler(self, handler: Handler) -> None:
        self._handlers.append(handler)

    async def events(self) -> AsyncIterator[tuple[EventType, RawBody]]:
        """Every change from now on, in order, until the iterator is closed."""
        subscription = _Subscription()
        self._subscriptions.append(subscription)
        try:
            while True:
                yield await subscription.queue.get()
        finally:
            self._subscriptions.remove(subscription)

    # --- lifecycle ---

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name=f"informer-{self.name}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task

    async def __aenter__(self) -> Informer:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def run(self) -> None:
        """List and watch until cancelled."""
        backoff = self.backoff_initial_s
        need_list = True
        while True:
            try:
                if need_list:
                    await self._list()
                    need_list = False
                    backoff = self.backoff_initial_s
                await self._watch()
                backoff = self.backoff_initial_s  # a watch that ended cleanly
            except KubeGone:
                self.stats.relists_410 += 1
                if self.metrics:
                    self.metrics.relists_410.labels(self.name).inc()
                need_list = True
                log.info(
                    "informer relists after 410 Gone",
                    extra={"informer": self.name, "resource_version": self.resource_version},
                )
            except asyncio.CancelledError:
                raise
            except (KubeError, aiohttp.ClientError, OSError, TimeoutError, ValueError) as err:
                self.stats.errors += 1
                if self.metrics:
                    self.metrics.errors.labels(self.name).inc()
                delay = random.uniform(backoff / 2, backoff)
                log.warning(
                    "informer request failed; retrying",
                    extra={
                        "informer": self.name,
                        "error": str(err) or type(err).__name__,
                        "retry_in_s": round(delay, 3),
                        "relist": need_list,
                    },
                )
                await asyncio.sleep(delay)
                backoff = min(backoff * 2, self.backoff_max_s)

    def _selectors(self) -> list[tuple[str, str]]:
        query: list[tuple[str, str]] = []
        if self.label_selector:
            query.append(("labelSelector", self.label_selector))
        if self.field_selector:
            query.append(("fieldSelector", self.field_selector))
        return query

    async def _list(self) -> None:
        path = self.resource.path(self.namespace)
        fresh: dict[Key, RawBody] = {}
        token = ""
        version = ""
        while True:
            query = self._selectors()
            if self.page_size:
                query.append(("limit", str(self.page_size)))
            if token:
                query.append(("continue", token))
            try:
                page = await call_json(
                    self.api, "GET", path, query=query, timeout_s=self.request_timeout_s
                )
            except KubeGone:
                raise  # the continue token expired: the caller starts over
            for item in page.get("items") or []:
                fresh[object_key(item)] = cast(RawBody, item)
            meta = page.get("metadata") or {}
            version = str(meta.get("resourceVersion") or "")
            token = str(meta.get("continue") or "")
            if not token:
                break
        self.stats.lists += 1
        await self._replace(fresh)
        self.resource_version = version
        log.debug(
            "informer listed",
            extra={"informer": self.name, "objects": len(fresh), "resource_version": version},
        )
        self.synced.set()
        if self.metrics:
            self.metrics.lists.labels(self.name).inc()
            self.metrics.synced.labels(self.name).set(1)

    async def _replace(self, fresh: dict[Key, RawBody]) -> None:
        """Swap in a fresh list: what vanished is DELETED, what is new ADDED, changes MODIFIED."""
        old = self._cache
        self._cache = dict(fresh)
        for key, obj in old.items():
            if key not in fresh:
                await self._emit("DELETED", obj)
        for key, obj in fresh.items():
            before = old.get(key)
            if before is None:
                await self._emit("ADDED", obj)
            elif _version(before) != _version(obj):
                await self._emit("MODIFIED", obj)

    async def _watch(self) -> None:
        timeout = random.uniform(self.watch_timeout_s, 2 * self.watch_timeout_s)
        query = [
            *self._selectors(),
            ("watch", "true"),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", str(int(timeout))),
        ]
        if self.resource_version:
            query.append(("resourceVersion", self.resource_version))
        self.stats.watches += 1
        response = await open_request(
            self.api,
            "GET",
            self.resource.path(self.namespace),
            query=query,
            # No total limit: the server ends the watch; a silent connection fails the read.
            timeout_s=(self.request_timeout_s, timeout + self.request_timeout_s),
        )
        try:
            while True:
                line = await response.content.readline()
                if not line:
                    return  # the server ended the watch: watch again from where we are
                if line.strip():
                    await self._apply(json.loads(line))
        finally:
            response.close()

    async def _apply(self, event: Mapping[str, Any]) -> None:
        kind = event.get("type")
        obj = cast(RawBody, event.get("object"))
        if not isinstance(obj, dict):
            raise ValueError(f"watch event without an object: {str(event)[:200]}")
        if kind == "ERROR":
            raise status_error(500, {"kind": "Status", **obj})
        version = _version(obj)
        if kind == "BOOKMARK":
            self.stats.bookmarks += 1
            if version:
                self.resource_version = version
            return
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            raise ValueError(f"unknown watch event type {kind!r}")
        key = object_key(obj)
        if kind == "DELETED":
            self._cache.pop(key, None)
        else:
            self._cache[key] = obj
        if version:
            self.resource_version = version
        self.stats.events += 1
        await self._emit(kind, obj)

    async def _emit(self, kind: EventType, obj: RawBody) -> None:
        if self.metrics:
            self.metrics.events.labels(self.name, kind).inc()
            self.metrics.objects.labels(self.name).set(len(self._cache))
        for handler in self._handlers:
            try:
                result = handler(kind, obj)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                self.stats.handler_errors += 1
                log.exception(
                    "informer handler failed",
                    extra={"informer": self.name, "event": kind, "object": object_key(obj)},
                )
        for subscription in self._subscriptions:
            subscription.queue.put_nowait((kind, obj))


def _version(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")
