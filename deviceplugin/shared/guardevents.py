"""The node guard's findings as Kubernetes Events on the pod, where its owner looks first.

The guard thread must never wait for the API server (the kill deadline does not move because the
network is slow), so each report is handed to the agent's event loop (``spawn``: the classic
agent's ``ApiLoop``, the DRA agent's own loop) and not waited for. At most ``QUEUE_SIZE`` posts
are in flight; beyond that a report is dropped and counted in the log; the guard's own log line
and metrics carry it anyway.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Any

from core import events
from core.kube import Api, KubeConfigError, KubeError
from core.units import MIB
from deviceplugin.shared.apiloop import Spawn
from deviceplugin.shared.guardtypes import Owner
from deviceplugin.shared.inventory import Card

log = logging.getLogger(__name__)

COMPONENT = "fracgpu-device-plugin"
REPORTING_COMPONENT = "fracgpu.io/device-plugin"
REASON_EXCESS = "GPUMemoryOverGrant"
REASON_KILLED = "GPUProcessKilled"
QUEUE_SIZE = 256


def _mib(value: int) -> str:
    return f"{value / MIB:.0f} MiB"


def excess_message(
    owner: Owner, card: Card, used: int, allowed: int, kill_in_s: float | None
) -> str:
    then = (
        f"its largest processes on that card are killed in {kill_in_s:g} s unless it frees memory"
        if kill_in_s is not None
        else "the node guard reports only (--no-guard-kill)"
    )
    return (
        f"container {owner.container} holds {_mib(used)} of card {card.index} ({card.uuid}) by "
        f"NVML's count, over the {_mib(allowed)} it may hold (its fracgpu.io/memory grant of "
        f"{_mib(owner.limits.memory_bytes)} plus each process's CUDA context); {then}. Lower the "
        f"program's memory use or request more fracgpu.io/memory."
    )


def killed_message(owner: Owner, card: Card, pid: int, used: int, allowed: int) -> str:
    return (
        f"killed process {pid} of container {owner.container}, holding {_mib(used)} of card "
        f"{card.index} ({card.uuid}), because the container stayed over the {_mib(allowed)} it "
        f"may hold; request more fracgpu.io/memory or lower the program's memory use"
    )


def event_body(owner: Owner, reason: str, message: str, node: str) -> dict[str, Any]:
    """A Warning Event on the pod, pointing at the container (``fieldPath``)."""
    return events.pod_event(
        namespace=owner.namespace,
        pod=owner.pod,
        uid=owner.pod_uid,
        reason=reason,
        message=message,
        component=COMPONENT,
        host=node,
        field_path=f"spec.containers{{{owner.container}}}",
    )


class EventReporter:
    """The guard's ``Reporter`` that posts Events on the pods of ``node``."""

    def __init__(self, node: str, spawn: Spawn, *, kill: bool) -> None:
        self.node = node
        self.kill = kill
        self._spawn = spawn
        self._lock = threading.Lock()
        self._in_flight = 0
        self.posted = 0
        self.dropped = 0
        self.failed = 0

    def excess(self, owner: Owner, card: Card, used: int, allowed: int, grace_s: float) -> None:
        message = excess_message(owner, card, used, allowed, grace_s if self.kill else None)
        self._put(event_body(owner, REASON_EXCESS, message, self.node))

    def killed(self, owner: Owner, card: Card, pid: int, used: int, allowed: int) -> None:
        message = killed_message(owner, card, pid, used, allowed)
        self._put(event_body(owner, REASON_KILLED, message, self.node))

    def _put(self, body: dict[str, Any]) -> None:
        with self._lock:
            full = self._in_flight >= QUEUE_SIZE
            if full:
                self.dropped += 1
            else:
                self._in_flight += 1
        if full:
            log.warning(
                "guard event dropped: the API server is not keeping up",
                extra={"reason": body["reason"], "pod": body["involvedObject"]["name"]},
            )
            return

        async def post(api: Api) -> None:
            await events.post(api, body)

        self._spawn(post).add_done_callback(lambda done: self._done(done, body))

    def _done(self, done: concurrent.futures.Future[Any], body: dict[str, Any]) -> None:
        with self._lock:
            self._in_flight -= 1
            error = None if done.cancelled() else done.exception()
            if done.cancelled() or error is not None:
                self.failed += 1
            else:
                self.posted += 1
        if isinstance(error, (KubeError, KubeConfigError, OSError, TimeoutError)):
            # RBAC, network, namespace gone, no API access: the log and metrics still report
            log.warning(
                "guard event not posted", extra={"reason": body["reason"], "error": str(error)}
            )
        elif error is not None:
            log.error(
                "guard event not posted", extra={"reason": body["reason"], "error": repr(error)}
            )


__all__ = ["EventReporter", "event_body"]
