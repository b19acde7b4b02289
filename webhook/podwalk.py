"""A pod's containers as admission walks them: where each sits, and what its resources name.

Normalising, the model choice, the claims a pod already holds and the checks each read the same
container lists; they walk them here, so that all of them skip the same malformed entries (the
API server refuses a pod with one, so nothing is lost by not rewriting it).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from webhook.resources import ContainerResult

CONTAINER_LISTS = ("initContainers", "containers")
EPHEMERAL_CONTAINERS = "ephemeralContainers"

Where = tuple[str, int]  # the container list and the index in it
Located = tuple[str, int, Mapping[str, Any], ContainerResult]  # list, index, container, result


def containers(
    spec: Mapping[str, Any], lists: tuple[str, ...] = CONTAINER_LISTS
) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """Every container of ``lists`` that is an object, with its list and its index in it."""
    for list_name in lists:
        found = spec.get(list_name)
        for index, container in enumerate(found if isinstance(found, list) else ()):
            if isinstance(container, dict):
                yield list_name, index, container


def resource_keys(section: object) -> list[str]:
    """The resource names of a ``limits`` or ``requests`` section (none when it is no map)."""
    return [str(k) for k in section] if isinstance(section, dict) else []
