"""Where ``GPUNodeLedger`` objects live, and the one way they change: compare-and-swap.

A store reads a node's ledger with its ``resourceVersion``, creates a missing one, and replaces
one *only if* its version is still the one read (else :class:`Conflict`). :func:`cas` is the
loop every writer uses: read, compute the next version from exactly the one read, write, and on
a conflict read again and recompute, a bounded number of times. Safety comes from the store's
check alone (invariant I1 of the memo holds by induction over stored versions); how many
writers there are, and who leads, only changes how often a write conflicts.

The in-memory store (tests, and the model check of the binder) follows the API server's rules:
versions are increasing integers, a create of an existing name conflicts, a replace of a
missing object is NotFound.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from core.kube import Api, KubeConflict, KubeNotFound, KubeUnavailable, Resource, call_answered
from extender.ledger import GROUP, PLURAL, VERSION, Ledger, LedgerError, from_object, to_object

GPUNODELEDGERS = Resource(GROUP, VERSION, PLURAL, namespaced=False)
CAS_ATTEMPTS = 5
"""Writes of one node's ledger conflict only with other writes of that node (a bind or a
reclaim); five reads in a row each overtaken means a storm, which the caller reports and the
scheduler retries."""


class Conflict(Exception):
    """The ledger changed since it was read, or already exists: read it again."""


class NotFound(Exception):
    """The ledger does not exist (any more)."""


class Unavailable(Exception):
    """The store could not be reached or did not answer in time; the text says how."""


class LedgerStore(Protocol):
    async def get(self, node: str) -> Ledger | None:
        """The node's ledger, or None when it has none yet."""
        ...

    async def create(self, ledger: Ledger) -> Ledger:
        """Store a new ledger; Conflict when one exists already."""
        ...

    async def replace(self, ledger: Ledger) -> Ledger:
        """Store ``ledger`` if the stored version is still ``ledger.version``; else Conflict."""
        ...

    def recalled(self, node: str) -> Ledger | None:
        """The node's ledger as this store last read or wrote it, without a request (None:
        not known, or the store does not recall). It may be stale."""
        ...


class TooManyConflicts(Exception):
    """Every attempt of a compare-and-swap was overtaken by another writer."""


async def cas(
    store: LedgerStore,
    node: str,
    change: Callable[[Ledger], Ledger],
    *,
    attempts: int = CAS_ATTEMPTS,
) -> Ledger:
    """Apply ``change`` to the node's stored ledger by compare-and-swap; the ledger it leaves.

    ``change`` gets the ledger as read (an empty one, version "", when there is none) and
    returns the next one, or the same object when nothing needs writing. It may raise to give
    up; it is called again, on a fresh read, after every conflict.

    A store that recalls the node's ledger (its own newest read or write) lets the first write
    go without a read: right unless another writer came between, and then the write conflicts
    and the loop reads afresh. Only a write is taken from a recalled ledger: a decision to write
    nothing, or to give up, is made again on a fresh read.
    """
    guess = store.recalled(node)
    if guess is not None:
        try:
            wanted = change(guess)
        except Exception:  # remade below on a fresh read, where it may stand
            wanted = guess
        if wanted is not guess:
            with contextlib.suppress(Conflict, NotFound):
                return await _write(store, guess, wanted)
    for _ in range(attempts):
        current = await store.get(node) or Ledger(node)
        wanted = change(current)
        if wanted is current:
            return current
        try:
            return await _write(store, current, wanted)
        except (Conflict, NotFound):
            continue
    raise TooManyConflicts(
        f"the GPUNodeLedger of node {node} changed under each of {attempts} writes in a row"
    )


async def _write(store: LedgerStore, current: Ledger, wanted: Ledger) -> Ledger:
    """``wanted`` stored only if the ledger is still ``current`` (created, if it had none)."""
    if not current.version:
        return await store.create(replace(wanted, version=""))
    return await store.replace(replace(wanted, version=current.version))


class MemoryLedgerStore:
    """Ledgers in memory, with the API server's version rules. Every call completes without
    awaiting, so each is atomic on one event loop; versions are still checked, because callers
    await between reading and writing."""

    def __init__(self) -> None:
        self.written = 0
        self.objects: dict[str, Ledger] = {}

    def copy(self) -> MemoryLedgerStore:
        """An independent store with the same objects and versions (a model check forks the
        world at every choice)."""
        twin = MemoryLedgerStore()
        twin.written = self.written
        twin.objects = dict(self.objects)  # ledgers are immutable
        return twin

    async def get(self, node: str) -> Ledger | None:
        return self.objects.get(node)

    def recalled(self, node: str) -> Ledger | None:
        return None  # every write starts from a read: the path the model check explores

    async def create(self, ledger: Ledger) -> Ledger:
        if ledger.node in self.objects:
            raise Conflict(f"gpunodeledgers.fracgpu.io {ledger.node!r} already exists")
        return self._store(ledger)

    async def replace(self, ledger: Ledger) -> Ledger:
        stored = self.objects.get(ledger.node)
        if stored is None:
            raise NotFound(f"gpunodeledgers.fracgpu.io {ledger.node!r} not found")
        if stored.version != ledger.version:
            raise Conflict(f"gpunodeledgers.fracgpu.io {ledger.node!r}: the object was modified")
        return self._store(ledger)

    def _store(self, ledger: Ledger) -> Ledger:
        self.written += 1
        stored = replace(ledger, version=str(self.written))
        self.objects[ledger.node] = stored
        return stored


class KubeLedgerStore:
    """Ledgers as ``GPUNodeLedger`` objects through the API server (``core.kube``).

    ``owner``: the UID of a node's Node object, when known, so that a new ledger is owned by its
    Node and garbage-collected with it.
    """

    def __init__(
        self,
        api: Api,
        *,
        owner: Callable[[str], str | None] = lambda node: None,
        request_timeout_s: float = 5.0,
        on_write: Callable[[str, float], None] = lambda outcome, seconds: None,
    ) -> None:
        self.api = api
        self.owner = owner
        # Told each write's outcome (written, conflict, error) and its duration (a metric).
        self.on_write = on_write
        self.request_timeout_s = request_timeout_s
        # The newest ledger this replica read or wrote, per node: filter reads the informer's
        # cache, which trails this replica's own writes by a watch event; a pod filtered in
        # between would pass on capacity just booked, and fail its bind.
        self.newest: dict[str, Ledger] = {}

    def _seen(self, ledger: Ledger) -> Ledger:
        self.newest[ledger.node] = newer(self.newest.get(ledger.node), ledger)
        return ledger

    def recalled(self, node: str) -> Ledger | None:
        return self.newest.get(node)

    async def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        try:
            return await call_answered(
                self.api, method, path, body=body, timeout_s=self.request_timeout_s
            )
        except KubeConflict as err:
            raise Conflict(err.message) from None
        except KubeNotFound as err:
            raise NotFound(err.message) from None
        except KubeUnavailable as err:
            raise Unavailable(str(err)) from None

    async def get(self, node: str) -> Ledger | None:
        try:
            return self._seen(_read(await self._call("GET", GPUNODELEDGERS.path(name=node))))
        except NotFound:
            self.newest.pop(node, None)
            return None

    async def create(self, ledger: Ledger) -> Ledger:
        body = to_object(ledger)
        uid = self.owner(ledger.node)
        if uid:
            body["metadata"]["ownerReferences"] = [
                {"apiVersion": "v1", "kind": "Node", "name": ledger.node, "uid": uid}
            ]
        return self._seen(_read(await self._write("POST", GPUNODELEDGERS.path(), body)))

    async def replace(self, ledger: Ledger) -> Ledger:
        path = GPUNODELEDGERS.path(name=ledger.node)
        return self._seen(_read(await self._write("PUT", path, to_object(ledger))))

    async def _write(self, method: str, path: str, body: Any) -> dict[str, Any]:
        start = time.perf_counter()
        outcome = "error"
        try:
            answer = await self._call(method, path, body)
            outcome = "written"
            return answer
        except (Conflict, NotFound):
            outcome = "conflict"
            raise
        finally:
            self.on_write(outcome, time.perf_counter() - start)


def _read(obj: dict[str, Any]) -> Ledger:
    """A stored ledger; one fracgpu cannot read is no ground to write over it."""
    try:
        return from_object(obj)
    except LedgerError as err:
        raise Unavailable(str(err)) from None


def newer(a: Ledger | None, b: Ledger | None) -> Ledger:
    """The later of two reads of one node's ledger, by resourceVersion (both may be None)."""
    if a is None or b is None:
        found = a or b
        assert found is not None
        return found
    return b if _version(b) >= _version(a) else a


def _version(ledger: Ledger) -> int:
    return int(ledger.version) if ledger.version.isdigit() else -1
