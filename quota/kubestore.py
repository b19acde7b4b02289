"""GPUQuota objects in the cluster, through kubernetes-asyncio (``core.kube``).

Status writes are PUTs of the ``/status`` subresource carrying the resourceVersion that was
read: the API server refuses a stale one with 409 Conflict, which is the compare-and-swap
the reservation engine and the controller rely on. Every call has its own timeout; every
failure to get an answer becomes :class:`Unavailable` with a message for the user.

With ``watch=True`` (the webhook), the quotas of a namespace are read from an informer, as
kube-apiserver's own ResourceQuota admission reads a lister, plus a look-aside of the newest
object this replica wrote: a batch of pods then costs one status write, not a list and a
write. A cached object that is stale only costs a 409 and a re-read; a namespace for which
the cache knows no quota is always listed live, so a missing or lagging cache never admits
a pod unaccounted, and an unreachable API server still denies GPU pods there.
"""

from __future__ import annotations

from typing import Any, cast

import aiohttp

from core.informer import Informers, InformerSettings
from core.kube import GPUQUOTAS, Api, KubeConflict, KubeError, KubeNotFound, call_json, object_key
from quota.model import API_VERSION
from quota.store import Conflict, NotFound, Obj, Unavailable


def _version(obj: Obj) -> int:
    text = str((obj.get("metadata") or {}).get("resourceVersion") or "")
    return int(text) if text.isdigit() else -1


class KubeQuotaStore:
    def __init__(
        self,
        api: Api,
        *,
        request_timeout_s: float = 2.0,
        watch: bool = False,
        informers: Informers | None = None,
    ) -> None:
        """``watch``: read from an informer, the process's shared one if ``informers``."""
        self.api = api
        self.request_timeout_s = request_timeout_s
        settings = InformerSettings(request_timeout_s=request_timeout_s)
        informers = informers or Informers(api, settings=settings)
        self._informer = informers.of(GPUQUOTAS) if watch else None
        self._started = False
        self._written: dict[tuple[str, str], Obj] = {}

    def start(self) -> None:
        if self._informer is not None and not self._started:
            self._started = True
            self._informer.start()

    async def stop(self) -> None:
        if self._informer is not None and self._started:
            self._started = False
            await self._informer.stop()

    def _newest(self, obj: Obj) -> Obj:
        """The cached object, or the one this replica wrote if that is newer."""
        key = object_key(obj)
        written = self._written.get(key)
        if written is None:
            return obj
        if _version(written) > _version(obj):
            return written
        del self._written[key]  # the cache caught up
        return obj

    async def _call(self, method: str, path: str, body: Any = None) -> Obj:
        try:
            return await call_json(
                self.api, method, path, body=body, timeout_s=self.request_timeout_s
            )
        except KubeConflict as err:
            raise Conflict(err.message) from None
        except KubeNotFound as err:
            raise NotFound(err.message) from None
        except KubeError as err:
            raise Unavailable(
                f"the Kubernetes API server answered {err.status} {err.reason}: {err.message}"
            ) from None
        except TimeoutError:
            raise Unavailable(
                f"the Kubernetes API server did not answer within {self.request_timeout_s:g}s"
            ) from None
        except (aiohttp.ClientError, OSError) as err:
            raise Unavailable(
                f"the Kubernetes API server could not be reached ({type(err).__name__}: {err})"
            ) from None

    async def list(self, namespace: str | None) -> list[Obj]:
        informer = self._informer
        if namespace is not None and informer is not None and informer.has_synced:
            cached = informer.objects(namespace)
            if cached:
                return [self._newest(cast(Obj, obj)) for obj in cached]
        answer = await self._call("GET", GPUQUOTAS.path(namespace))
        items = answer.get("items") or []
        for item in items:  # list items of custom resources keep these, but be sure
            item.setdefault("apiVersion", API_VERSION)
            item.setdefault("kind", "GPUQuota")
        return [item for item in items if isinstance(item, dict)]

    async def get(self, namespace: str, name: str) -> Obj:
        try:
            obj = await self._call("GET", GPUQUOTAS.path(namespace, name))
        except NotFound:
            self._written.pop((namespace, name), None)
            raise
        if self._informer is not None:
            self._written[(namespace, name)] = obj
        return obj

    async def reread(self, namespace: str, name: str, than: str) -> tuple[Obj, bool]:
        """After a 409 the winner's write is often in the watch cache already: a retry then
        costs no read. Only a cached object newer than the one that conflicted is used."""
        informer = self._informer
        if informer is not None and informer.has_synced:
            for cached in informer.objects(namespace):
                if (cached.get("metadata") or {}).get("name") == name:
                    newest = self._newest(cast(Obj, cached))
                    stale = int(than) if than.isdigit() else -1
                    if _version(newest) > stale:
                        return newest, False
        return await self.get(namespace, name), True

    async def write_status(self, obj: Obj) -> Obj:
        meta = obj.get("metadata") or {}
        path = GPUQUOTAS.path(meta.get("namespace"), meta.get("name")) + "/status"
        try:
            stored = await self._call("PUT", path, body=obj)
        except NotFound:
            self._written.pop(object_key(obj), None)
            raise
        if self._informer is not None:
            self._written[object_key(stored)] = stored
        return stored
