"""The node guard's findings as Kubernetes Events on the pod, where its owner looks first.

The guard thread must never wait for the API server (the kill deadline does not move because the
network is slow), so reports go into a bounded queue that a thread of this module drains with its
own event loop. When the queue is full a report is dropped and counted in the log; the guard's
own log line and metrics carry it anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from typing import Any

from core import events
from core.kube import Api, KubeConfigError, KubeError, kube_client
from core.units import MIB
from deviceplugin.config import Config
from deviceplugin.guard import Owner
from deviceplugin.inventory import Card

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
    """The guard's ``Reporter`` that posts Events (needs ``node_name``, like the publisher)."""

    def __init__(self, config: Config, *, kill: bool) -> None:
        assert config.node_name is not None
        self.config = config
        self.node = config.node_name
        self.kill = kill
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(QUEUE_SIZE)
        self._thread: threading.Thread | None = None
        self.posted = 0
        self.dropped = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="guard-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        # A full queue means the thread is stuck on the API server; it is a daemon thread.
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=1)
        self._thread.join(timeout=5)

    def excess(self, owner: Owner, card: Card, used: int, allowed: int, grace_s: float) -> None:
        message = excess_message(owner, card, used, allowed, grace_s if self.kill else None)
        self._put(event_body(owner, REASON_EXCESS, message, self.node))

    def killed(self, owner: Owner, card: Card, pid: int, used: int, allowed: int) -> None:
        message = killed_message(owner, card, pid, used, allowed)
        self._put(event_body(owner, REASON_KILLED, message, self.node))

    def _put(self, body: dict[str, Any]) -> None:
        try:
            self._queue.put_nowait(body)
        except queue.Full:
            self.dropped += 1
            log.warning(
                "guard event dropped: the API server is not keeping up",
                extra={"reason": body["reason"], "pod": body["involvedObject"]["name"]},
            )

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        try:
            async with kube_client(self.config.kubeconfig) as api:
                while (body := await asyncio.to_thread(self._queue.get)) is not None:
                    await self._post(api, body)
        except KubeConfigError as exc:  # no API access: the guard's log and metrics still report
            log.error("guard events disabled: no API access", extra={"error": str(exc)})

    async def _post(self, api: Api, body: dict[str, Any]) -> None:
        try:
            await events.post(api, body)
            self.posted += 1
        except (KubeError, OSError, TimeoutError) as exc:  # RBAC, network, namespace gone
            log.warning(
                "guard event not posted", extra={"reason": body["reason"], "error": str(exc)}
            )


__all__ = ["EventReporter", "event_body"]
