"""Pods read from the API server directly, for the moments the usage controller's cache may lag.

Dropping what an admission or the ``unmatched`` aggregate holds is safe only if the pods they
stand for are counted: those decisions read pods live (:mod:`quota.recount`). Every failure to
reach the API server is :class:`quota.store.Unavailable`, so the pass is retried later.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from core.kube import PODS, Api, KubeError, KubeNotFound, call_json
from quota.store import Unavailable

# A consistent list of a namespace's pods, this many per request.
PAGE_SIZE = 500


class LivePods:
    def __init__(
        self, api: Api, *, request_timeout_s: float = 2.0, page_size: int = PAGE_SIZE
    ) -> None:
        self.api = api
        self.request_timeout_s = request_timeout_s
        self.page_size = page_size

    async def read(self, namespace: str) -> list[dict[str, Any]]:
        """Every pod of the namespace, read live (a consistent list, page by page)."""
        pods: list[dict[str, Any]] = []
        token = ""
        while True:
            query = [("limit", str(self.page_size))] + ([("continue", token)] if token else [])
            try:
                page = await call_json(
                    self.api,
                    "GET",
                    PODS.path(namespace),
                    query=query,
                    timeout_s=self.request_timeout_s,
                )
            except (KubeError, TimeoutError, OSError, aiohttp.ClientError) as err:
                raise Unavailable(f"pods of {namespace}: {err}") from None
            pods.extend(p for p in page.get("items") or [] if isinstance(p, dict))
            token = str((page.get("metadata") or {}).get("continue") or "")
            if not token:
                return pods

    async def exists(self, namespace: str, name: str, uid: str) -> bool:
        """Whether the pod of an expired admission exists after all (the cache may lag)."""
        if not name or name.endswith("<generated>"):
            return False
        try:
            pod = await call_json(
                self.api, "GET", PODS.path(namespace, name), timeout_s=self.request_timeout_s
            )
        except KubeNotFound:
            return False
        except KubeError as err:
            raise Unavailable(f"pod {namespace}/{name}: {err}") from None
        except (TimeoutError, OSError, aiohttp.ClientError) as err:
            raise Unavailable(f"pod {namespace}/{name}: {err}") from None
        return str((pod.get("metadata") or {}).get("uid")) == uid
