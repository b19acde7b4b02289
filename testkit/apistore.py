"""Storage behind the fake API server: a multi-version object store modelled on etcd + watch cache.

What it keeps, and why:
- One global resourceVersion counter across all kinds (etcd's revision), so versions from
  different resources compare, as clients assume.
- A history of every change since the last compaction. Watches replay it from any version at or
  after the compaction point; older versions get 410 Gone. Lists can read a snapshot at any
  retained version (rolling the history back), which is what `continue` tokens and
  `resourceVersionMatch=Exact` need. `compact()` is the test's handle on history loss.
- Subscribed watchers, each fed every change in commit order (the server is single-threaded
  asyncio, so a replay computed and a subscription registered in one synchronous step can never
  miss or duplicate a change).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from testkit.kinds import Kind

Obj = dict[str, Any]
Key = tuple[str, str]  # (namespace or "", name)


def clone(obj: Mapping[str, Any]) -> Obj:
    """A deep copy; stored objects are plain JSON, so a JSON round trip is exact."""
    copied: Obj = json.loads(json.dumps(obj))
    return copied


def key_of(obj: Mapping[str, Any]) -> Key:
    meta = obj["metadata"]
    return (meta.get("namespace") or "", meta["name"])


@dataclass(frozen=True)
class Change:
    rv: int
    kind: Kind
    key: Key
    type: str  # ADDED, MODIFIED, DELETED
    obj: Obj  # the object after the change (for DELETED: as deleted, carrying the new version)
    before: Obj | None  # the object before the change (None for ADDED)


@dataclass(frozen=True)
class Bookmark:
    rv: int


@dataclass(frozen=True)
class Close:
    abort: bool  # True: drop the connection; False: end the stream cleanly


WatchItem = Change | Bookmark | Close


@dataclass(eq=False)
class Watcher:
    kind: Kind
    namespace: str | None  # None: every namespace (or a cluster-scoped kind)
    matches: Callable[[Mapping[str, Any]], bool]
    bookmarks: bool
    queue: asyncio.Queue[WatchItem] = field(default_factory=asyncio.Queue)

    def in_scope(self, change: Change) -> bool:
        return change.kind == self.kind and (
            self.namespace is None or change.key[0] == self.namespace
        )

    def translate(self, change: Change) -> tuple[str, Obj] | None:
        """The event this watcher sees, as the real server filters: an object that stops matching
        the selector is DELETED for this watcher, one that starts matching is ADDED."""
        if not self.in_scope(change):
            return None
        now = change.type != "DELETED" and self.matches(change.obj)
        was = change.before is not None and self.matches(change.before)
        if change.type == "DELETED":
            return ("DELETED", change.obj) if self.matches(change.obj) else None
        if now and was:
            return ("MODIFIED", change.obj)
        if now:
            return ("ADDED", change.obj)
        if was:
            return ("DELETED", change.obj)
        return None


class TooOld(Exception):
    """The requested version is older than the compacted history (HTTP 410 Gone)."""

    def __init__(self, requested: int, oldest: int) -> None:
        super().__init__(f"too old resource version: {requested} ({oldest})")
        self.requested = requested
        self.oldest = oldest


class Store:
    def __init__(self) -> None:
        self.rv = 1  # versions start above 0, which clients read as "any version"
        self.floor = 1  # history is complete for every version >= floor
        self._objects: dict[Kind, dict[Key, Obj]] = {}
        self._history: list[Change] = []
        self._watchers: set[Watcher] = set()

    # --- reads ---------------------------------------------------------------------------

    def get(self, kind: Kind, key: Key) -> Obj | None:
        obj = self._objects.get(kind, {}).get(key)
        return None if obj is None else clone(obj)

    def peek(self, kind: Kind, key: Key) -> Obj | None:
        """The stored object itself (no copy): for read-only checks on hot paths."""
        return self._objects.get(kind, {}).get(key)

    def snapshot(self, kind: Kind, at: int) -> dict[Key, Obj]:
        """The kind's objects as they were at version `at` (not copied; do not mutate)."""
        if at < self.floor:
            raise TooOld(at, self.floor)
        state = dict(self._objects.get(kind, {}))
        for change in reversed(self._history):
            if change.rv <= at:
                break
            if change.kind != kind:
                continue
            if change.before is None:
                state.pop(change.key, None)
            else:
                state[change.key] = change.before
        return state

    def keys(self, kind: Kind) -> Iterator[Key]:
        return iter(list(self._objects.get(kind, {})))

    def changes_since(self, rv: int) -> list[Change]:
        if rv < self.floor:
            raise TooOld(rv, self.floor)
        # History is ordered by version; scan from the end since watches resume near the head.
        start = len(self._history)
        while start > 0 and self._history[start - 1].rv > rv:
            start -= 1
        return self._history[start:]

    # --- writes --------------------------------------------------------------------------

    def _commit(self, kind: Kind, change_type: str, obj: Obj, before: Obj | None) -> Obj:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        key = key_of(obj)
        stored = clone(obj)
        bucket = self._objects.setdefault(kind, {})
        if change_type == "DELETED":
            bucket.pop(key, None)
        else:
            bucket[key] = stored
        change = Change(self.rv, kind, key, change_type, stored, before)
        self._history.append(change)
        for watcher in self._watchers:
            if watcher.in_scope(change):
                watcher.queue.put_nowait(change)
        return clone(stored)

    def create(self, kind: Kind, obj: Obj) -> Obj:
        return self._commit(kind, "ADDED", obj, None)

    def update(self, kind: Kind, obj: Obj) -> Obj:
        before = self._objects[kind][key_of(obj)]
        return self._commit(kind, "MODIFIED", obj, before)

    def delete(self, kind: Kind, key: Key, final: Obj | None = None) -> Obj:
        """Remove an object; `final` is its state as deleted when that differs from the stored
        one (the last finalizer removed in the same write)."""
        before = self._objects[kind][key]
        return self._commit(kind, "DELETED", clone(final if final is not None else before), before)

    def compact(self, upto: int | None = None) -> None:
        """Forget history up to `upto` (default: everything so far), as etcd compaction does."""
        target = self.rv if upto is None else min(upto, self.rv)
        if target <= self.floor:
            return
        self.floor = target
        self._history = [c for c in self._history if c.rv > target]

    # --- watchers ------------------------------------------------------------------------

    def subscribe(self, watcher: Watcher) -> None:
        self._watchers.add(watcher)

    def unsubscribe(self, watcher: Watcher) -> None:
        self._watchers.discard(watcher)

    @property
    def watchers(self) -> frozenset[Watcher]:
        return frozenset(self._watchers)

    def bookmark_all(self) -> None:
        """Queue a bookmark at the current version behind whatever each watcher has queued."""
        for watcher in self._watchers:
            if watcher.bookmarks:
                watcher.queue.put_nowait(Bookmark(self.rv))

    def close_all(self, *, abort: bool) -> None:
        for watcher in self._watchers:
            watcher.queue.put_nowait(Close(abort))
