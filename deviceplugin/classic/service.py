"""The kubelet-facing gRPC side: one DevicePlugin service per resource, and registration.

Each resource gets its own socket in kubelet's device-plugin directory and its own Register call.
``Supervisor`` serves before it registers (kubelet dials back inside Register), and watches for a
kubelet restart by polling: when ``kubelet.sock`` is a new file (new inode) or one of the plugin's
own sockets has gone (kubelet deletes them when it starts), it serves on fresh sockets and registers
again. Polling every ``watch_interval_s`` (default 0.25 s) keeps re-registration well under the
2 s target without inotify.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc

from deviceplugin._proto import deviceplugin_v1beta1_pb2 as pb
from deviceplugin._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from deviceplugin.classic.allocation import AllocationError
from deviceplugin.classic.ids import Kind
from deviceplugin.classic.listing import ListedDevice
from deviceplugin.classic.plugin import (
    DevicePlugin,
    NotListedError,
    WaitingError,
    endpoint_socket,
)
from deviceplugin.classic.prestart import PreStartError
from deviceplugin.classic.records import RecordUnavailable
from deviceplugin.shared.podresources import PodResourcesError

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
HEALTH = {True: "Healthy", False: "Unhealthy"}
# The synchronous gRPC server holds one worker thread per open ListAndWatch stream. kubelet opens
# one; any local client that can reach the socket could open more and, with a shared pool, leave
# no thread for kubelet's Allocate. Streams beyond MAX_STREAMS are refused at once, and the pool
# keeps UNARY_WORKERS threads for the unary RPCs whatever the streams hold.
MAX_STREAMS = 4
UNARY_WORKERS = 8


def _encode(devices: tuple[ListedDevice, ...]) -> bytes:
    """One card's devices as a serialised ListAndWatchResponse."""
    message = pb.ListAndWatchResponse()
    for device in devices:
        message.devices.add(ID=device.id, health=HEALTH[device.healthy])
    encoded: bytes = message.SerializeToString()
    return encoded


class DevicePluginServicer(pb_grpc.DevicePluginServicer):  # type: ignore[misc]
    def __init__(self, plugin: DevicePlugin, kind: Kind, stopping: threading.Event) -> None:
        self.plugin = plugin
        self.kind = kind
        self.resource = plugin.resource(kind)
        self._stopping = stopping
        # per card: the allocator's device list (compared by identity) and its encoding
        self._pieces: list[tuple[tuple[ListedDevice, ...], bytes]] = []
        self._open = 0  # ListAndWatch streams running, under _open_changed
        self._open_changed = threading.Condition()

    def _fail(
        self, context: grpc.ServicerContext, rpc: str, code: grpc.StatusCode, msg: str
    ) -> None:
        self.plugin.metrics.failures.labels(self.resource, rpc).inc()
        log.warning("rpc failed", extra={"resource": self.resource, "rpc": rpc, "error": msg})
        context.abort(code, msg)

    def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(
            pre_start_required=True, get_preferred_allocation_available=False
        )

    def ListAndWatch(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> Iterator[pb.ListAndWatchResponse]:
        with self._open_changed:
            full = self._open >= MAX_STREAMS
            if not full:
                self._open += 1
        if full:
            self._fail(
                context,
                "ListAndWatch",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.resource}: {MAX_STREAMS} ListAndWatch streams are open already; kubelet "
                f"needs one. Close the others (a client other than kubelet holds them)",
            )
        try:
            yield from self._watch(context)
        finally:
            with self._open_changed:
                self._open -= 1
                self._open_changed.notify_all()

    def wait_closed(self, timeout: float) -> bool:
        """Whether every ListAndWatch stream ended within timeout.

        gRPC's stop returns while a stream's worker thread may still be inside the allocator's
        wait (up to 0.25 s before it sees the stop): a stop that returned then would leave that
        thread running, and logging, past the end of everything that owns it.
        """
        with self._open_changed:
            return self._open_changed.wait_for(lambda: self._open == 0, timeout)

    def _watch(self, context: grpc.ServicerContext) -> Iterator[pb.ListAndWatchResponse]:
        allocator = self.plugin.allocator
        seen = -1
        sent: object = None
        log.info("ListAndWatch opened", extra={"resource": self.resource})
        while context.is_active() and not self._stopping.is_set():
            version = allocator.wait_for_change(seen, timeout=0.25)
            if version == seen:
                continue
            seen = version
            # one snapshot for both: a signature read apart from its list could be skipped later
            signature, cards = allocator.listing(self.kind)
            if signature == sent:
                continue  # most allocations change nothing kubelet sees (allocated stays Healthy)
            sent = signature
            yield self._listing(cards)
        log.info("ListAndWatch closed", extra={"resource": self.resource})

    def _listing(self, cards: list[tuple[ListedDevice, ...]]) -> pb.ListAndWatchResponse:
        """The full device list, assembled from per-card serialised pieces.

        A full node lists thousands of devices and a change usually concerns one card (it
        filled up, it failed), so only that card's piece is encoded again; repeated fields
        concatenate on the wire. Building every entry anew held the interpreter for ~7 ms per
        resend of an 8-card node's 2,560 memory devices, beside the Allocate that caused it.
        """
        previous = self._pieces
        pieces = []
        for i, devices in enumerate(cards):
            if i < len(previous) and previous[i][0] is devices:
                pieces.append(previous[i])
            else:
                pieces.append((devices, _encode(devices)))
        self._pieces = pieces
        return pb.ListAndWatchResponse.FromString(b"".join(piece for _, piece in pieces))

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        with self.plugin.metrics.rpc_seconds.labels("GetPreferredAllocation").time():
            response = pb.PreferredAllocationResponse()
            for container in request.container_requests:
                chosen = self.plugin.allocator.preferred(
                    self.kind,
                    container.available_deviceIDs,
                    container.must_include_deviceIDs,
                    container.allocation_size,
                )
                response.container_responses.add(deviceIDs=chosen)
            return response

    def Allocate(
        self, request: pb.AllocateRequest, context: grpc.ServicerContext
    ) -> pb.AllocateResponse:
        with self.plugin.metrics.rpc_seconds.labels("Allocate").time():
            response = pb.AllocateResponse()
            if not request.container_requests:
                self._fail(
                    context,
                    "Allocate",
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{self.resource}: Allocate named no containers",
                )
            for container in request.container_requests:
                try:
                    answer = self.plugin.allocate(self.kind, list(container.devices_ids))
                except AllocationError as exc:
                    self._fail(context, "Allocate", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                response.container_responses.append(answer)
            return response

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        with self.plugin.metrics.rpc_seconds.labels("PreStartContainer").time():
            try:
                self.plugin.prestart(self.kind, list(request.devices_ids))
            except (PodResourcesError, NotListedError, WaitingError, RecordUnavailable) as exc:
                self._fail(context, "PreStartContainer", grpc.StatusCode.UNAVAILABLE, str(exc))
            except PreStartError as exc:
                self._fail(
                    context, "PreStartContainer", grpc.StatusCode.FAILED_PRECONDITION, str(exc)
                )
            except OSError as exc:
                self._fail(
                    context,
                    "PreStartContainer",
                    grpc.StatusCode.INTERNAL,
                    f"{self.resource}: cannot write the limits file: {exc}",
                )
            return pb.PreStartContainerResponse()


class Endpoint:
    """One resource's gRPC server on its unix socket."""

    def __init__(self, plugin: DevicePlugin, kind: Kind, socket: Path) -> None:
        self.plugin = plugin
        self.kind = kind
        self.socket = socket
        self._server: grpc.Server | None = None
        self._servicer: DevicePluginServicer | None = None
        self._stopping = threading.Event()

    def start(self) -> None:
        self.socket.unlink(missing_ok=True)
        self._stopping = threading.Event()
        pool = futures.ThreadPoolExecutor(
            max_workers=MAX_STREAMS + UNARY_WORKERS, thread_name_prefix="dp"
        )
        server = grpc.server(pool)
        self._servicer = DevicePluginServicer(self.plugin, self.kind, self._stopping)
        pb_grpc.add_DevicePluginServicer_to_server(self._servicer, server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.stop(grace=0.1).wait(2)
            self._server = None
        if self._servicer is not None and not self._servicer.wait_closed(2):
            log.warning(
                "ListAndWatch streams still open 2 s after the stop",
                extra={"resource": self._servicer.resource},
            )
        self._servicer = None


class Supervisor:
    """Serves both resources, registers them, and re-registers after kubelet restarts."""

    def __init__(self, plugin: DevicePlugin) -> None:
        self.plugin = plugin
        config = plugin.config
        self.kubelet_socket = config.plugin_dir / KUBELET_SOCKET
        self.endpoints = [
            Endpoint(plugin, kind, endpoint_socket(config.plugin_dir, kind))
            for kind in (Kind.CORE, Kind.MEMORY)
        ]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._registered_inode: int | None = None
        self.registered = False
        self._last_error = ""

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kubelet-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for endpoint in self.endpoints:
            endpoint.stop()
            endpoint.socket.unlink(missing_ok=True)

    def _kubelet_inode(self) -> int | None:
        try:
            return os.stat(self.kubelet_socket).st_ino
        except FileNotFoundError:
            return None

    def needs_registration(self) -> bool:
        inode = self._kubelet_inode()
        if inode is None:
            return False  # no kubelet to register with yet; keep serving
        if not self.registered or inode != self._registered_inode:
            return True
        return any(not e.socket.exists() for e in self.endpoints)

    def _run(self) -> None:
        interval = self.plugin.config.watch_interval_s
        while not self._stop.is_set():
            if self.needs_registration():
                self._reregister()
            self._stop.wait(interval)

    def _reregister(self) -> None:
        inode = self._kubelet_inode()
        if self.registered:
            log.info("kubelet restarted (kubelet.sock re-created or our socket deleted)")
        self.registered = False
        for endpoint in self.endpoints:
            self.plugin.metrics.registered.labels(endpoint.plugin.resource(endpoint.kind)).set(0)
            endpoint.stop()
            endpoint.start()  # serve first: kubelet dials back inside Register
        try:
            for endpoint in self.endpoints:
                self._register(endpoint)
        except grpc.RpcError as exc:
            message = f"{exc.code().name}: {exc.details()}"
            if message != self._last_error:
                log.error("registration failed; retrying", extra={"error": message})
            self._last_error = message
            return
        self._last_error = ""
        self._registered_inode = inode
        self.registered = True

    def _register(self, endpoint: Endpoint) -> None:
        resource = self.plugin.resource(endpoint.kind)
        started = time.monotonic()
        with grpc.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
            pb_grpc.RegistrationStub(channel).Register(
                pb.RegisterRequest(
                    version=API_VERSION,
                    endpoint=endpoint.socket.name,
                    resource_name=resource,
                    options=pb.DevicePluginOptions(
                        pre_start_required=True, get_preferred_allocation_available=False
                    ),
                ),
                timeout=self.plugin.config.register_timeout_s,
                wait_for_ready=True,
            )
        self.plugin.metrics.registered.labels(resource).set(1)
        self.plugin.metrics.registrations.labels(resource).inc()
        log.info(
            "registered with kubelet",
            extra={
                "resource": resource,
                "endpoint": endpoint.socket.name,
                "seconds": round(time.monotonic() - started, 3),
            },
        )
