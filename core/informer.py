"""A cache of one kind's objects kept current by list + watch.

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

Its tuning (page size, timeouts, backoff) is one ``InformerSettings``; callers say what to
watch and who to tell.

One process watches each kind once (``Informers``, as client-go's shared informer factory):
two components of ``fracgpu serve`` that each held a watch on pods made the API server encode
and send every pod event twice and this process decode it twice, a cost paid on every pod
create. A shared informer runs while anyone uses it (``start``/``stop`` count the users), and a
handler added after its first list is first told of every cached object, as ADDED.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge

from core.kube import (
    Api,
    Key,
    KubeError,
    KubeGone,
    RawBody,
    Resource,
    call_json,
    object_key,
    open_request,
    status_error,
)

log = logging.getLogger(__name__)

EventType = Literal["ADDED", "MODIFIED", "DELETED"]
Handler = Callable[[EventType, RawBody], Awaitable[None] | None]


@dataclass(frozen=True, slots=True)
class InformerSettings:
    """How an informer pages, waits and backs off; the defaults suit every caller but tests."""

    page_size: int = 500
    watch_timeout_s: float = 300.0
    request_timeout_s: float = 30.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0


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
        name: str | None = None,
        metrics: InformerMetrics | None = None,
        settings: InformerSettings = InformerSettings(),
    ) -> None:
        self.api = api
        self.metrics = metrics
        self.resource = resource
        self.namespace = namespace
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.settings = settings
        self.name = name or resource.plural
        self.resource_version = ""
        self.synced = asyncio.Event()
        self.stats = InformerStats()
        self._cache: dict[Key, RawBody] = {}
        self._handlers: list[Handler] = [handler] if handler else []
        self._subscriptions: list[_Subscription] = []
        self._task: asyncio.Task[None] | None = None
        self._users = 0

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
        """Tell ``handler`` of every change from now on. Once the informer has listed, it is
        first told of every cached object as ADDED (so it must then be a plain function: the
        replay runs in one piece, before any later event)."""
        if self.has_synced:
            call = getattr(handler, "__call__", None)  # noqa: B004 (async callable objects)
            if inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(call):
                raise TypeError("a handler added after the first list must not be async")
            for obj in list(self._cache.values()):
                handler("ADDED", obj)
        self._handlers.append(handler)

    def remove_handler(self, handler: Handler) -> None:
        with suppress(ValueError):
            self._handlers.remove(handler)

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
        """Run for one more user (list and watch from the first)."""
        self._users += 1
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name=f"informer-{self.name}")

    async def stop(self) -> None:
        """One user less; the last one stops the watch."""
        self._users = max(0, self._users - 1)
        if self._users:
            return
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
        # Started again, it lists afresh: a cache from before is not "synced" with anything.
        # Handlers that stay (an inventory kept from it) are told it is forgotten, so that the
        # fresh list's ADDED is all they hold, and nothing that vanished meanwhile lingers.
        forgotten, self._cache, self.resource_version = self._cache, {}, ""
        self.synced.clear()
        if self.metrics:
            self.metrics.synced.labels(self.name).set(0)
        for obj in forgotten.values():
            await self._emit("DELETED", obj)

    async def __aenter__(self) -> Informer:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def run(self) -> None:
        """List and watch until cancelled."""
        backoff = self.settings.backoff_initial_s
        need_list = True
        while True:
            try:
                if need_list:
                    await self._list()
                    need_list = False
                    backoff = self.settings.backoff_initial_s
                await self._watch()
                backoff = self.settings.backoff_initial_s  # a watch that ended cleanly
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
                backoff = min(backoff * 2, self.settings.backoff_max_s)

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
            if self.settings.page_size:
                query.append(("limit", str(self.settings.page_size)))
            if token:
                query.append(("continue", token))
            try:
                page = await call_json(
                    self.api, "GET", path, query=query, timeout_s=self.settings.request_timeout_s
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
        timeout = random.uniform(self.settings.watch_timeout_s, 2 * self.settings.watch_timeout_s)
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
            timeout_s=(self.settings.request_timeout_s, timeout + self.settings.request_timeout_s),
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


class Informers:
    """The informers of one process, one per kind and selector, shared by every component
    that asks (see the module docstring). Each asker still starts and stops what it uses."""

    def __init__(
        self,
        api: Api,
        *,
        metrics: InformerMetrics | None = None,
        settings: InformerSettings = InformerSettings(),
    ) -> None:
        self.api = api
        self.metrics = metrics
        self.settings = settings
        self._made: dict[tuple[str, str, str, str], Informer] = {}

    def of(
        self,
        resource: Resource,
        *,
        namespace: str | None = None,
        label_selector: str = "",
        field_selector: str = "",
    ) -> Informer:
        key = (resource.path(), namespace or "", label_selector, field_selector)
        informer = self._made.get(key)
        if informer is None:
            selectors = ",".join(s for s in (label_selector, field_selector) if s)
            informer = Informer(
                self.api,
                resource,
                namespace=namespace,
                label_selector=label_selector,
                field_selector=field_selector,
                name=resource.plural + (f"[{selectors}]" if selectors else ""),
                metrics=self.metrics,
                settings=self.settings,
            )
            self._made[key] = informer
        return informer
