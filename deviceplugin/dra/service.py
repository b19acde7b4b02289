"""The kubelet-facing gRPC side of DRA mode: registration, v1.DRAPlugin and the health stream.

Two unix sockets, as kubelet's plugin watcher expects:
- ``plugins_registry/<driver>-reg.sock``: ``pluginregistration.Registration``. kubelet finds it
  (it watches the directory), calls GetInfo with a 1 s deadline, so GetInfo answers from memory
  and never waits on the API server or NVML, then NotifyRegistrationStatus;
- ``plugins/<driver>/dra.sock`` (the endpoint GetInfo names): ``v1.DRAPlugin`` and
  ``v1alpha1.DRAResourceHealth`` on one server, since kubelet keeps one connection per plugin.

The service socket is served before the registration socket exists, so kubelet never dials an
endpoint that is not there yet. A socket file that disappears (a person, a cleanup script) is
served again; kubelet then registers the plugin again within about a second.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import suppress

import grpc

from deviceplugin._proto import dra_v1_pb2 as dra
from deviceplugin._proto import dra_v1_pb2_grpc as dra_grpc
from deviceplugin._proto import drahealth_v1alpha1_pb2 as health
from deviceplugin._proto import drahealth_v1alpha1_pb2_grpc as health_grpc
from deviceplugin._proto import pluginregistration_v1_pb2 as reg
from deviceplugin._proto import pluginregistration_v1_pb2_grpc as reg_grpc
from deviceplugin.dra.claims import ClaimRef
from deviceplugin.dra.config import DraConfig
from deviceplugin.dra.driver import DraDriver
from deviceplugin.dra.metrics import DraMetrics
from deviceplugin.dra.slices import CardState, device_name

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
DRA_SERVICE = "v1.DRAPlugin"
HEALTH_SERVICE = "v1alpha1.DRAResourceHealth"
# kubelet takes the first entry it knows: v1 first. The health entry is informational.
SUPPORTED_VERSIONS = (DRA_SERVICE, HEALTH_SERVICE)
MAX_HEALTH_MESSAGE = 1024


class CardBoard:
    """The cards' health as the plugin currently sees it, on the event loop: the slice and the
    health stream both read it, and both are told when it changes."""

    def __init__(self, states: list[CardState]) -> None:
        self._states = {s.card.index: s for s in states}
        self.version = 0
        self._changed = asyncio.Condition()
        self._listeners: list[Callable[[], None]] = []

    def states(self) -> list[CardState]:
        return [self._states[i] for i in sorted(self._states)]

    def health_of(self, index: int) -> tuple[bool, str]:
        """A card's health and, when unhealthy, why."""
        state = self._states.get(index)
        return (True, "") if state is None else (state.healthy, state.reason)

    def on_change(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    async def set_health(self, index: int, healthy: bool, reason: str) -> None:
        state = self._states.get(index)
        if state is None or (state.healthy == healthy and state.reason == reason):
            return
        self._states[index] = CardState(state.card, state.details, healthy, reason)
        self.version += 1
        for listener in self._listeners:
            listener()
        async with self._changed:
            self._changed.notify_all()

    async def wait_change(self, seen: int, timeout_s: float) -> int:
        async with self._changed:
            # asyncio.timeout, not wait_for, which can swallow a cancellation in Python 3.11.
            with suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._changed.wait_for(lambda: self.version != seen)
        return self.version


class RegistrationServicer(reg_grpc.RegistrationServicer):  # type: ignore[misc]
    def __init__(self, config: DraConfig, metrics: DraMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.registered = False
        self.info = reg.PluginInfo(
            type=PLUGIN_TYPE,
            name=config.driver_name,
            endpoint=str(config.service_socket),
            supported_versions=list(SUPPORTED_VERSIONS),
        )

    async def GetInfo(
        self, request: reg.InfoRequest, context: grpc.aio.ServicerContext
    ) -> reg.PluginInfo:
        return self.info

    async def NotifyRegistrationStatus(
        self, request: reg.RegistrationStatus, context: grpc.aio.ServicerContext
    ) -> reg.RegistrationStatusResponse:
        self.registered = bool(request.plugin_registered)
        self.metrics.registered.set(1 if self.registered else 0)
        if self.registered:
            self.metrics.registrations.inc()
            log.info("registered with kubelet", extra={"driver": self.config.driver_name})
        else:
            log.error(
                "kubelet refused the registration",
                extra={"driver": self.config.driver_name, "error": request.error},
            )
        return reg.RegistrationStatusResponse()


class DraPluginServicer(dra_grpc.DRAPluginServicer):  # type: ignore[misc]
    def __init__(self, driver: DraDriver, metrics: DraMetrics) -> None:
        self.driver = driver
        self.metrics = metrics

    @staticmethod
    def _refs(claims: object) -> tuple[list[ClaimRef], dict[str, str]]:
        """The claims kubelet named; those missing a field get an error of their own."""
        refs, errors = [], {}
        for claim in claims:  # type: ignore[attr-defined]
            ref = ClaimRef(claim.namespace, claim.name, claim.uid)
            missing = [f for f in ("namespace", "name", "uid") if not getattr(claim, f)]
            if missing:
                errors[claim.uid] = f"{ref}: kubelet sent no {', '.join(missing)}"
            else:
                refs.append(ref)
        return refs, errors

    async def NodePrepareResources(
        self, request: dra.NodePrepareResourcesRequest, context: grpc.aio.ServicerContext
    ) -> dra.NodePrepareResourcesResponse:
        started = time.perf_counter()
        refs, errors = self._refs(request.claims)
        outcomes = await self.driver.prepare(refs)
        response = dra.NodePrepareResourcesResponse()
        for uid, error in errors.items():
            response.claims[uid].error = error
        for uid, outcome in outcomes.items():
            answer = response.claims[uid]
            if outcome.prepared is None:
                answer.error = outcome.error
                self.metrics.failures.labels("NodePrepareResources").inc()
                continue
            for result, cdi_id in zip(
                outcome.prepared.results, outcome.prepared.cdi_ids, strict=True
            ):
                device = answer.devices.add(
                    request_names=[result.request] if result.request else [],
                    pool_name=result.pool,
                    device_name=result.device,
                    cdi_device_ids=[cdi_id],
                )
                if result.share_id:
                    device.share_id = result.share_id
        self.metrics.rpc_seconds.labels("NodePrepareResources").observe(
            time.perf_counter() - started
        )
        self.metrics.prepared.set(len(self.driver.prepared))
        return response

    async def NodeUnprepareResources(
        self, request: dra.NodeUnprepareResourcesRequest, context: grpc.aio.ServicerContext
    ) -> dra.NodeUnprepareResourcesResponse:
        started = time.perf_counter()
        refs, errors = self._refs(request.claims)
        errors.update(await self.driver.unprepare(refs))
        response = dra.NodeUnprepareResourcesResponse()
        for uid, error in errors.items():
            response.claims[uid].error = error
            if error:
                self.metrics.failures.labels("NodeUnprepareResources").inc()
        self.metrics.rpc_seconds.labels("NodeUnprepareResources").observe(
            time.perf_counter() - started
        )
        self.metrics.prepared.set(len(self.driver.prepared))
        return response


class HealthServicer(health_grpc.DRAResourceHealthServicer):  # type: ignore[misc]
    def __init__(self, config: DraConfig, board: CardBoard, stopping: asyncio.Event) -> None:
        self.config = config
        self.board = board
        self._stopping = stopping

    def snapshot(self) -> health.NodeWatchResourcesResponse:
        now = int(time.time())
        response = health.NodeWatchResourcesResponse()
        for state in self.board.states():
            response.devices.add(
                device=health.DeviceIdentifier(
                    pool_name=self.config.pool_name, device_name=device_name(state.card.index)
                ),
                health=health.HEALTHY if state.healthy else health.UNHEALTHY,
                last_updated_time=now,
                health_check_timeout_seconds=self.config.health_timeout_s,
                message=(state.reason if not state.healthy else "answers NVML")[
                    :MAX_HEALTH_MESSAGE
                ],
            )
        return response

    async def NodeWatchResources(
        self, request: health.NodeWatchResourcesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[health.NodeWatchResourcesResponse]:
        log.info("health stream opened")
        seen = self.board.version
        yield self.snapshot()
        while not self._stopping.is_set():
            # A full list on every change, and again before kubelet's timeout would turn a
            # quiet device Unknown.
            seen = await self.board.wait_change(seen, self.config.health_resend_s)
            yield self.snapshot()
        log.info("health stream closed")


class PluginServers:
    """Both gRPC servers, their sockets, and serving them again when a socket file vanishes."""

    def __init__(
        self, config: DraConfig, driver: DraDriver, board: CardBoard, metrics: DraMetrics
    ) -> None:
        self.config = config
        self.registration = RegistrationServicer(config, metrics)
        self.plugin = DraPluginServicer(driver, metrics)
        self._stopping = asyncio.Event()
        self.health = HealthServicer(config, board, self._stopping)
        self._service: grpc.aio.Server | None = None
        self._registry: grpc.aio.Server | None = None
        self._watch: asyncio.Task[None] | None = None
        self.restarts = 0

    async def _serve_service(self) -> None:
        socket = self.config.service_socket
        socket.parent.mkdir(parents=True, exist_ok=True)
        socket.unlink(missing_ok=True)
        server = grpc.aio.server()
        dra_grpc.add_DRAPluginServicer_to_server(self.plugin, server)
        health_grpc.add_DRAResourceHealthServicer_to_server(self.health, server)
        server.add_insecure_port(f"unix://{socket}")
        await server.start()
        self._service = server

    async def _serve_registry(self) -> None:
        socket = self.config.registry_socket
        socket.parent.mkdir(parents=True, exist_ok=True)
        socket.unlink(missing_ok=True)
        server = grpc.aio.server()
        reg_grpc.add_RegistrationServicer_to_server(self.registration, server)
        server.add_insecure_port(f"unix://{socket}")
        await server.start()
        self._registry = server

    async def start(self) -> None:
        self._stopping.clear()
        await self._serve_service()
        await self._serve_registry()
        self._watch = asyncio.create_task(self._watch_sockets(), name="dra-sockets")
        log.info(
            "serving kubelet",
            extra={
                "registration": str(self.config.registry_socket),
                "endpoint": str(self.config.service_socket),
            },
        )

    async def _watch_sockets(self) -> None:
        while True:
            await asyncio.sleep(self.config.socket_check_s)
            if not self.config.service_socket.exists():
                log.warning("service socket vanished; serving it again")
                await _stop(self._service)
                await self._serve_service()
                # kubelet must dial the new socket: register anew.
                await _stop(self._registry)
                await self._serve_registry()
                self.restarts += 1
            elif not self.config.registry_socket.exists():
                log.warning("registration socket vanished; serving it again")
                self.registration.registered = False
                await _stop(self._registry)
                await self._serve_registry()
                self.restarts += 1

    async def stop(self) -> None:
        """Stop serving and remove our sockets: kubelet deregisters the plugin."""
        self._stopping.set()
        if self._watch is not None:
            self._watch.cancel()
            with suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None
        await _stop(self._registry)
        self._registry = None
        self.config.registry_socket.unlink(missing_ok=True)
        await _stop(self._service)
        self._service = None
        self.config.service_socket.unlink(missing_ok=True)


async def _stop(server: grpc.aio.Server | None) -> None:
    if server is not None:
        await server.stop(grace=0.2)
