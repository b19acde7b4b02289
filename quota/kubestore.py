"""GPUQuota objects in the cluster, through kubernetes-asyncio (``webhook.kube``).

Status writes are PUTs of the ``/status`` subresource carrying the resourceVersion that was
read: the API server refuses a stale one with 409 Conflict, which is the compare-and-swap
the reservation engine and the controller rely on. Every call has its own timeout; every
failure to get an answer becomes :class:`Unavailable` with a message for the user.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from quota.store import Conflict, NotFound, Obj, Unavailable
from webhook.kube import GPUQUOTAS, KubeError, call_json


class KubeQuotaStore:
    def __init__(self, api: Any, *, request_timeout_s: float = 2.0) -> None:
        self.api = api
        self.request_timeout_s = request_timeout_s

    async def _call(self, method: str, path: str, body: Any = None) -> Obj:
        try:
            return await call_json(
                self.api, method, path, body=body, timeout_s=self.request_timeout_s
            )
        except KubeError as err:
            if err.status == 409:
                raise Conflict(err.message) from None
            if err.status == 404:
                raise NotFound(err.message) from None
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
        answer = await self._call("GET", GPUQUOTAS.path(namespace))
        items = answer.get("items") or []
        for item in items:  # list items of custom resources keep these, but be sure
            item.setdefault("apiVersion", "fracgpu.io/v1")
            item.setdefault("kind", "GPUQuota")
        return [item for item in items if isinstance(item, dict)]

    async def get(self, namespace: str, name: str) -> Obj:
        return await self._call("GET", GPUQUOTAS.path(namespace, name))

    async def write_status(self, obj: Obj) -> Obj:
        meta = obj.get("metadata") or {}
        path = GPUQUOTAS.path(meta.get("namespace"), meta.get("name")) + "/status"
        return await self._call("PUT", path, body=obj)
