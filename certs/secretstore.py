"""Managed certificates in a Kubernetes Secret, shared by every webhook replica.

The Secret's resourceVersion is the store's version. Creating it is create-if-absent decided by
the API server: the first replica's POST wins (201), the others get 409 AlreadyExists and
re-read. Renewals are PUTs carrying the resourceVersion that was read; a stale one gets 409
Conflict and the writer re-reads. No leader election is needed for certificates.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Collection, Mapping
from typing import Any

from certs.material import MANAGED_FILES
from certs.stores import Files, StoreConflict
from core.kube import SECRETS, Api, KubeConflict, KubeNotFound, call_json

log = logging.getLogger(__name__)

MANAGED_BY = {"app.kubernetes.io/managed-by": "fracgpu", "app.kubernetes.io/component": "webhook"}
SECRET_TYPE = "kubernetes.io/tls"  # tls.crt and tls.key are there; kubectl shows it as such


class SecretStore:
    def __init__(
        self, api: Api, namespace: str, name: str, *, keys: Collection[str] = MANAGED_FILES
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name
        # The Secret's keys this store reads (the scheduler's client Secret has other ones).
        self.keys = frozenset(keys)
        # The Secret as last read, so that a replace keeps labels and annotations others set.
        self._read: dict[str, Any] | None = None

    @property
    def description(self) -> str:
        return f"Secret {self.namespace}/{self.name}"

    async def load(self) -> tuple[Files | None, str | None]:
        try:
            obj = await call_json(self.api, "GET", SECRETS.path(self.namespace, self.name))
        except KubeNotFound:
            self._read = None
            return None, None
        self._read = obj
        version = str(obj["metadata"]["resourceVersion"])
        data = obj.get("data") or {}
        files = {k: base64.b64decode(v) for k, v in data.items() if k in self.keys}
        # An existing but empty Secret (created by a chart, say) is filled with a replace.
        return (files or None), version

    async def save(self, files: Mapping[str, bytes], version: str | None) -> str:
        data = {k: base64.b64encode(v).decode("ascii") for k, v in files.items()}
        body: dict[str, Any]
        if version is None:
            body = {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": self.name, "namespace": self.namespace, "labels": MANAGED_BY},
                "type": SECRET_TYPE,
                "data": data,
            }
            return await self._write("POST", SECRETS.path(self.namespace), body)
        previous = self._read if self._version_of(self._read) == version else None
        body = dict(previous or {"apiVersion": "v1", "kind": "Secret"})
        metadata: dict[str, Any] = dict(body.get("metadata") or {})
        metadata.update(name=self.name, namespace=self.namespace, resourceVersion=version)
        metadata["labels"] = {**(metadata.get("labels") or {}), **MANAGED_BY}
        body["metadata"] = metadata
        body["data"] = {**(body.get("data") or {}), **data}
        body.setdefault("type", SECRET_TYPE)
        return await self._write("PUT", SECRETS.path(self.namespace, self.name), body)

    async def _write(self, method: str, path: str, body: dict[str, Any]) -> str:
        try:
            obj = await call_json(self.api, method, path, body=body)
        except (KubeConflict, KubeNotFound) as err:
            # 409: another replica created or updated it first; 404 on PUT: deleted since read.
            if isinstance(err, KubeNotFound) and method != "PUT":
                raise
            raise StoreConflict(f"{self.description}: {err.reason}: {err.message}") from err
        self._read = obj
        return str(obj["metadata"]["resourceVersion"])

    @staticmethod
    def _version_of(obj: dict[str, Any] | None) -> str | None:
        return None if obj is None else str(obj["metadata"]["resourceVersion"])
