"""The two pod operations the extender makes: read one pod, and post its Binding.

A Binding's ``metadata.uid`` is a storage precondition (so a Binding for a deleted pod never lands
on a new pod of the same name) and its ``metadata.annotations`` are merged into the pod in the
same update that sets ``spec.nodeName``: the record and the bind are one write, and kubelet can
never see the pod without its record.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from core.kube import PODS, Api, KubeConflict, KubeNotFound, KubeUnavailable, call_answered

Obj = dict[str, Any]


class BindConflict(Exception):
    """409 on the Binding: the pod is bound already, or its UID is not the one bound."""


class PodGone(Exception):
    """404: the pod does not exist."""


class PodApiDown(Exception):
    """The API server could not be reached or refused otherwise; the text says how."""


class PodApi(Protocol):
    async def get(self, namespace: str, name: str) -> Obj | None:
        """The pod, or None when there is none by that name."""
        ...

    async def bind(
        self, namespace: str, name: str, uid: str, node: str, annotations: Mapping[str, str]
    ) -> None:
        """Post the pod's Binding; BindConflict, PodGone or PodApiDown when it did not land."""
        ...


def binding(namespace: str, name: str, uid: str, node: str, annotations: Mapping[str, str]) -> Obj:
    """The Binding object: the UID precondition, the record, the target node."""
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "uid": uid}
    if annotations:
        metadata["annotations"] = dict(annotations)
    return {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": metadata,
        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
    }


class KubePods:
    """Pods through the API server (``core.kube``)."""

    def __init__(self, api: Api, *, request_timeout_s: float = 5.0) -> None:
        self.api = api
        self.request_timeout_s = request_timeout_s

    async def _call(self, method: str, path: str, body: Any = None) -> Obj:
        try:
            return await call_answered(
                self.api, method, path, body=body, timeout_s=self.request_timeout_s
            )
        except KubeConflict as err:
            raise BindConflict(err.message) from None
        except KubeNotFound as err:
            raise PodGone(err.message) from None
        except KubeUnavailable as err:
            raise PodApiDown(str(err)) from None

    async def get(self, namespace: str, name: str) -> Obj | None:
        try:
            return await self._call("GET", PODS.path(namespace, name))
        except PodGone:
            return None

    async def bind(
        self, namespace: str, name: str, uid: str, node: str, annotations: Mapping[str, str]
    ) -> None:
        path = PODS.path(namespace, name) + "/binding"
        await self._call("POST", path, binding(namespace, name, uid, node, annotations))
