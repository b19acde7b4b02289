"""kube-scheduler's extender v1 wire types, as the scheduler sends and reads them.

``k8s.io/kube-scheduler/extender/v1/types.go`` has no json tags, so Go's encoder writes the Go
field names exactly (``Pod``, ``NodeNames``, ``FailedAndUnresolvableNodes``); the models here use
those names as aliases and write them back the same way. Go's decoder matches keys without
regard to case, so a reply in these spellings is read as meant.

Two details the scheduler relies on: with ``nodeCacheCapable`` a ``NodeNames`` of ``null`` means
*no node passes*, silently; so a reply always carries a list, empty when nothing fits. A
prioritize reply is a bare JSON array of ``{"Host", "Score"}`` with scores 0..10
(``MaxExtenderPriority``).

The Pod and Nodes stay plain dicts (as ``core.kube`` keeps objects): the extender reads a few
fields of them, and a typed Pod model would only cost time on the scheduler's serial path.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

MAX_EXTENDER_PRIORITY = 10


class _Go(BaseModel):
    """Go field names on the wire; unknown keys (a newer scheduler's) are ignored."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    def wire(self) -> dict[str, Any]:
        """The JSON object as the scheduler expects it (Go field names, nulls kept)."""
        return self.model_dump(by_alias=True, mode="json")


class NodeList(_Go):
    """The part of a ``v1.NodeList`` the extender reads (``nodeCacheCapable: false``)."""

    items: list[dict[str, Any]] = Field(default_factory=list)

    @field_validator("items", mode="before")
    @classmethod
    def _none_is_empty(cls, value: object) -> object:
        return [] if value is None else value


class ExtenderArgs(_Go):
    """A filter or prioritize request: the pod and the nodes still feasible."""

    pod: dict[str, Any] = Field(alias="Pod")
    nodes: NodeList | None = Field(default=None, alias="Nodes")
    node_names: list[str] | None = Field(default=None, alias="NodeNames")

    def names(self) -> list[str]:
        """The candidate nodes' names, whichever way the scheduler sent them."""
        if self.node_names is not None:
            return list(self.node_names)
        if self.nodes is not None:
            return [str((n.get("metadata") or {}).get("name") or "") for n in self.nodes.items]
        return []


class ExtenderFilterResult(_Go):
    """A filter reply. ``NodeNames`` is always a list (``null`` would mean: none pass)."""

    nodes: NodeList | None = Field(default=None, alias="Nodes")
    node_names: list[str] = Field(default_factory=list, alias="NodeNames")
    failed_nodes: dict[str, str] = Field(default_factory=dict, alias="FailedNodes")
    failed_and_unresolvable: dict[str, str] = Field(
        default_factory=dict, alias="FailedAndUnresolvableNodes"
    )
    error: str = Field(default="", alias="Error")


class HostPriority(_Go):
    """One node's score from prioritize, 0..10."""

    host: str = Field(alias="Host")
    score: int = Field(alias="Score", ge=0, le=MAX_EXTENDER_PRIORITY)


HOST_PRIORITY_LIST: TypeAdapter[list[HostPriority]] = TypeAdapter(list[HostPriority])


def priorities_wire(scores: list[HostPriority]) -> list[dict[str, Any]]:
    """A ``HostPriorityList``: a bare array."""
    return [s.wire() for s in scores]


class ExtenderBindingArgs(_Go):
    """A bind request: the pod (name, namespace, UID) and the node the scheduler chose."""

    pod_name: str = Field(alias="PodName", min_length=1)
    pod_namespace: str = Field(alias="PodNamespace", min_length=1)
    pod_uid: str = Field(alias="PodUID", min_length=1)
    node: str = Field(alias="Node", min_length=1)


class ExtenderBindingResult(_Go):
    """A bind reply; an empty ``Error`` is success."""

    error: str = Field(default="", alias="Error")
