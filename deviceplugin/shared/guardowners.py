"""The node guard's attribution: from a container as its cgroup names it (guardproc.py) to the
fracgpu container and grant that hold it, using only what the container cannot change.

1. ``<container_logs>/<pod>_<namespace>_<container>-<id>.log``: kubelet links every container's
   log there, whatever the runtime, to ``…/pods/<namespace>_<pod>_<uid>/<container>/<n>.log``.
   The link's target names the pod, its namespace and UID and the container; the UID must equal
   the cgroup's, so a pod deleted and created again under the same name is never confused.
2. kubelet's PodResources ``List`` (the agent's client): what the container holds, from which
   the agent names its *grant*, the directory whose limits file the hook enforces: in
   device-plugin mode the container's own (named after its device IDs), in DRA mode its claim's
   (a claim shared by several containers is one grant, one accounting region, and the guard
   adds up their processes as the hook does).

A container that fails a step (a container of another device plugin, a pod that holds no
fracgpu resource) has no owner. Resolutions are cached per container ID (a container's devices
never change); a miss is retried after ``miss_retry_s``, doubling up to a minute, so foreign GPU
containers cost one PodResources call a minute each.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from core.contract import Limits, LimitsError
from deviceplugin.shared.guardtypes import ContainerRef, Owner
from deviceplugin.shared.hostfiles import read_limits
from deviceplugin.shared.podresources import ContainerDevices, PodResourcesError

# The guard's lines keep one logger, whichever of its modules writes them: operators and tests
# select the guard's log by this name.
log = logging.getLogger("deviceplugin.shared.guard")

# ``<namespace>_<pod>_<uid>/<container>/<n>.log`` under kubelet's pod log directory.
_LOG_TARGET = re.compile(r"([^/_]+)_([^/_]+)_([0-9a-f][0-9a-f-]{31,35})/([^/]+)/[^/]+$")
MAX_MISS_RETRY_S = 60.0
FORGET_AFTER_S = 300.0


class GrantError(RuntimeError):
    """No grant can be named for a listed container (no limits file yet, an unknown claim)."""


ListContainers = Callable[[], list[ContainerDevices]]
LimitsDir = Callable[[ContainerDevices], Path]
Grant = Callable[[ContainerDevices], tuple[str, Limits]]


def grant_from(limits_dir: LimitsDir) -> Grant:
    """A container's grant: the limits file the agent wrote before the container ran, in the
    directory ``limits_dir`` names for it (the agent's own layout; GrantError if none)."""

    def grant(container: ContainerDevices) -> tuple[str, Limits]:
        directory = limits_dir(container)
        try:
            return str(directory), read_limits(directory)
        except (OSError, UnicodeDecodeError, LimitsError) as exc:
            raise GrantError(f"container {container.name} has no limits file: {exc}") from None

    return grant


def parse_log_target(target: str, pod_uid: str) -> tuple[str, str, str] | None:
    """(namespace, pod, container) from a kubelet log link's target, if it names ``pod_uid``."""
    match = _LOG_TARGET.search(target)
    if match is None or match.group(3) != pod_uid:
        return None
    return match.group(1), match.group(2), match.group(4)


@dataclass(slots=True)
class _Miss:
    retry_at: float
    wait_s: float


class Owners:
    """From a cgroup's container to the fracgpu container that holds it, cached."""

    def __init__(
        self,
        container_logs: Path,
        list_containers: ListContainers,
        grant: Grant,
        *,
        miss_retry_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.container_logs = container_logs
        self._list = list_containers
        self._grant = grant
        self.miss_retry_s = miss_retry_s
        self._clock = clock
        self._known: dict[ContainerRef, tuple[Owner, float]] = {}
        self._misses: dict[ContainerRef, _Miss] = {}

    def resolve(self, ref: ContainerRef) -> Owner | None:
        now = self._clock()
        known = self._known.get(ref)
        if known is not None:
            self._known[ref] = (known[0], now)
            return known[0]
        miss = self._misses.get(ref)
        if miss is not None and now < miss.retry_at:
            return None
        owner = self._lookup(ref)
        if owner is None:
            wait = self.miss_retry_s if miss is None else min(miss.wait_s * 2, MAX_MISS_RETRY_S)
            self._misses[ref] = _Miss(now + wait, wait)
            return None
        self._misses.pop(ref, None)
        self._known[ref] = (owner, now)
        return owner

    def forget_idle(self) -> None:
        """Drop what was not asked about for a while (containers end; the cache must not grow)."""
        horizon = self._clock() - FORGET_AFTER_S
        for ref in [r for r, (_, seen) in self._known.items() if seen < horizon]:
            del self._known[ref]
        for ref in [r for r, m in self._misses.items() if m.retry_at < horizon]:
            del self._misses[ref]

    def _named(self, ref: ContainerRef) -> tuple[str, str, str] | None:
        """(namespace, pod, container) from kubelet's log link of this container."""
        try:
            links = list(self.container_logs.glob(f"*-{ref.container_id}.log"))
        except OSError:
            return None
        for link in links:
            try:
                target = os.readlink(link)
            except OSError:
                continue
            named = parse_log_target(target, ref.pod_uid)
            if named is not None:
                return named
        return None

    def _lookup(self, ref: ContainerRef) -> Owner | None:
        named = self._named(ref)
        if named is None:
            return None
        namespace, pod, container = named
        try:
            listed = self._list()
        except PodResourcesError as exc:
            log.warning("guard cannot list pod resources", extra={"error": str(exc)})
            return None
        for entry in listed:
            if (entry.namespace, entry.pod, entry.container) != named:
                continue
            try:
                grant, limits = self._grant(entry)
            except GrantError as exc:
                log.warning(
                    "guard cannot compute a grant",
                    extra={"container": entry.name, "error": str(exc)},
                )
                return None
            return Owner(namespace, pod, container, ref.pod_uid, ref.container_id, limits, grant)
        return None


__all__ = [
    "FORGET_AFTER_S",
    "MAX_MISS_RETRY_S",
    "Grant",
    "GrantError",
    "LimitsDir",
    "ListContainers",
    "Owners",
    "grant_from",
    "parse_log_target",
]
