"""Where GPUQuota objects live: the interface both stores implement, and the in-memory store.

A store offers exactly what optimistic concurrency needs: read objects with their
resourceVersion, and write a status *only if* the version is still the one read (else
:class:`Conflict`). Everything above it (the reservation engine, the controller) is the same
code in embedded and in Kubernetes mode, so both have the same semantics.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import yaml

from quota.model import API_VERSION, KIND, GPUQuota, QuotaError

Obj = dict[str, Any]


class Conflict(Exception):
    """The object changed since it was read (HTTP 409): re-read and try again."""


class NotFound(Exception):
    """The object does not exist (any more)."""


class Unavailable(Exception):
    """The store could not be reached or did not answer in time; the message says how."""


class QuotaStore(Protocol):
    async def list(self, namespace: str | None) -> list[Obj]:
        """Every GPUQuota of a namespace (None: of all namespaces), as raw objects."""
        ...

    async def get(self, namespace: str, name: str) -> Obj: ...

    async def reread(self, namespace: str, name: str, than: str) -> tuple[Obj, bool]:
        """The object newer than resourceVersion ``than`` (after a 409), and whether it was
        read live: from a watch cache that already has a newer one, else with a GET."""
        ...

    async def write_status(self, obj: Obj) -> Obj:
        """Replace the status if ``metadata.resourceVersion`` is current; the stored object."""
        ...


class MemoryStore:
    """GPUQuotas held in memory (embedded mode), with the same resourceVersion rules.

    Every call completes without awaiting, so on one event loop it is atomic; versions are
    still checked, because callers await between reading and writing.
    """

    def __init__(self, objects: Iterable[Mapping[str, Any]] = ()) -> None:
        self._versions = itertools.count(1)
        self._objects: dict[tuple[str, str], Obj] = {}
        for obj in objects:
            self.put(obj)

    def put(self, obj: Mapping[str, Any]) -> Obj:
        stored = copy.deepcopy(dict(obj))
        meta = stored.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        meta["resourceVersion"] = str(next(self._versions))
        self._objects[(meta["namespace"], meta["name"])] = stored
        return copy.deepcopy(stored)

    async def list(self, namespace: str | None) -> list[Obj]:
        return [
            copy.deepcopy(obj)
            for (ns, _), obj in sorted(self._objects.items())
            if namespace is None or ns == namespace
        ]

    async def get(self, namespace: str, name: str) -> Obj:
        obj = self._objects.get((namespace, name))
        if obj is None:
            raise NotFound(f"GPUQuota {namespace}/{name} not found")
        return copy.deepcopy(obj)

    async def reread(self, namespace: str, name: str, than: str) -> tuple[Obj, bool]:
        return await self.get(namespace, name), True

    async def write_status(self, obj: Obj) -> Obj:
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        current = self._objects.get(key)
        if current is None:
            raise NotFound(f"GPUQuota {key[0]}/{key[1]} not found")
        if current["metadata"]["resourceVersion"] != meta.get("resourceVersion"):
            raise Conflict(f"GPUQuota {key[0]}/{key[1]} changed since it was read")
        updated = copy.deepcopy(current)
        updated["status"] = copy.deepcopy(obj.get("status"))
        return self.put(updated)


def load_quota_file(path: Path | str) -> list[Obj]:
    """GPUQuota objects from a YAML file (one or more documents, or a ``List``), checked.

    Every object is parsed here so that a typo fails at start-up with the quota's name and
    the field, not at the first GPU pod.
    """
    text = Path(path).read_text()
    objects: list[Obj] = []
    try:
        documents = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        raise QuotaError(f"quota file {str(path)!r} is not YAML: {exc}") from None
    for doc in documents:
        if doc is None:
            continue
        items = doc.get("items") if isinstance(doc, dict) and doc.get("kind") == "List" else [doc]
        for item in items or []:
            if not isinstance(item, dict) or item.get("kind") != KIND:
                raise QuotaError(
                    f"quota file {str(path)!r}: every document must be a {KIND} "
                    f"(apiVersion {API_VERSION}); got kind {_kind_of(item)!r}"
                )
            if item.get("apiVersion") != API_VERSION:
                raise QuotaError(
                    f"quota file {str(path)!r}: {KIND} must have apiVersion {API_VERSION}; "
                    f"got {item.get('apiVersion')!r}"
                )
            meta = item.setdefault("metadata", {})
            if not isinstance(meta, dict) or not meta.get("name"):
                raise QuotaError(f"quota file {str(path)!r}: a {KIND} has no metadata.name")
            meta.setdefault("namespace", "default")
            GPUQuota(item)  # raises QuotaError naming the quota and the field
            objects.append(item)
    return objects


def _kind_of(item: object) -> object:
    return item.get("kind") if isinstance(item, dict) else type(item).__name__
