"""FakeDraKubelet: a strict test double of kubelet's DRA side (plugin watcher and DRA manager).

Real gRPC (grpc.aio) on unix sockets, behaving as a Kubernetes 1.36 kubelet did with a Python
plugin of fracgpu's shape, and refusing what it refuses:

- it watches ``<root>/plugins_registry`` (polling every ``scan_s``, as kubelet's 1 s reconcile
  loop does; names starting with ``.`` and files that are not sockets are ignored), dials a new
  socket and calls GetInfo with a **1 s** deadline; the answer must have type ``DRAPlugin``, a
  name, an absolute endpoint (or none: then the registration socket), and a
  ``supported_versions`` list whose first entry kubelet knows (``v1.DRAPlugin`` or
  ``v1beta1.DRAPlugin``) is taken; otherwise it sends NotifyRegistrationStatus(false, error);
  else NotifyRegistrationStatus(true), one connection to the endpoint, and the
  ``v1alpha1`` health stream opened on it (every message must list every device the plugin
  reported before; messages at most 1024 characters);
- a registration socket that disappears unregisters the plugin; ``wiping_delay_s`` after the
  last plugin of a driver went away (30 s in kubelet) the driver's slices on the node are
  deleted through the API server;
- ``prepare(pod, claims)``: as kubelet before calling the plugin, each claim is read from the API
  server and must be reserved for the pod; a claim already prepared on the node (shared) is
  skipped; then one NodePrepareResources for the rest, 45 s deadline. The answer must name every
  claim UID and no other; any per-claim error fails the pod's prepare (``PrepareFailed``);
  devices need a pool and device name and fully qualified CDI IDs. What succeeded is recorded
  (kubelet's checkpoint) with its CDI IDs;
- ``unprepare(claims)``: NodeUnprepareResources; every UID must be answered;
- ``restart()``: closes the connection, deletes **all** of the node's ResourceSlices (kubelet
  does at start), then registers every socket found again; prepared claims survive (they are
  never prepared again for running pods).
"""

from __future__ import annotations

import asyncio
import re
import stat
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from core.kube import RESOURCE_CLAIMS, RESOURCE_SLICES, call_json
from deviceplugin._proto import dra_v1_pb2 as dra
from deviceplugin._proto import dra_v1_pb2_grpc as dra_grpc
from deviceplugin._proto import drahealth_v1alpha1_pb2 as health
from deviceplugin._proto import drahealth_v1alpha1_pb2_grpc as health_grpc
from deviceplugin._proto import pluginregistration_v1_pb2 as reg
from deviceplugin._proto import pluginregistration_v1_pb2_grpc as reg_grpc

KNOWN_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
GETINFO_TIMEOUT_S = 1.0
CALL_TIMEOUT_S = 45.0
_CDI_ID = re.compile(
    r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9][-A-Za-z0-9_.]*=[A-Za-z0-9][-A-Za-z0-9_.:]*$"
)


class ProtocolViolation(AssertionError):
    """The plugin did something a real kubelet refuses."""


class PrepareFailed(RuntimeError):
    """kubelet would report FailedPrepareDynamicResources and retry on the next sync."""


@dataclass
class Plugin:
    driver: str
    registration: Path
    endpoint: str
    service: str
    channel: grpc.aio.Channel
    health_task: asyncio.Task[None] | None = None
    health: list[health.NodeWatchResourcesResponse] = field(default_factory=list)
    registered_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class ClaimKey:
    namespace: str
    name: str
    uid: str


class FakeDraKubelet:
    def __init__(
        self,
        root: Path,
        node: str,
        api: Any,
        *,
        scan_s: float = 0.05,
        wiping_delay_s: float = 30.0,
    ) -> None:
        self.root = root
        self.registry = root / "plugins_registry"
        self.node = node
        self.api = api
        self.scan_s = scan_s
        self.wiping_delay_s = wiping_delay_s
        self.plugins: dict[str, Plugin] = {}  # by driver
        self.refused: list[str] = []  # registration errors sent back
        self.violations: list[str] = []
        self.getinfo_seconds: list[float] = []
        self.prepared: dict[str, tuple[ClaimKey, list[dra.Device]]] = {}  # kubelet checkpoint
        self._sockets: dict[Path, tuple[int, int]] = {}  # socket -> (inode, ctime) seen
        self.registrations = 0
        self._task: asyncio.Task[None] | None = None
        self._wipes: dict[str, asyncio.TimerHandle] = {}
        self.wiped: list[str] = []

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self.registry.mkdir(parents=True, exist_ok=True)
        self._task = asyncio.create_task(self._watch(), name="fake-kubelet-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for handle in self._wipes.values():
            handle.cancel()
        self._wipes.clear()
        for driver in list(self.plugins):
            await self._drop(driver, schedule_wipe=False)
        self._sockets.clear()

    async def restart(self) -> None:
        """kubelet restarts: connections close, the node's slices are deleted, plugins found
        in the registry directory register again."""
        await self.stop()
        await call_json(
            self.api,
            "DELETE",
            RESOURCE_SLICES.path(),
            query=[("fieldSelector", f"spec.nodeName={self.node}")],
        )
        self.wiped.append("kubelet start")
        await self.start()

    # ---- registration ----------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            present: dict[Path, tuple[int, int]] = {}
            for path in sorted(self.registry.iterdir()):
                if path.name.startswith("."):
                    continue
                try:
                    info = path.stat()
                except FileNotFoundError:
                    continue
                if stat.S_ISSOCK(info.st_mode):
                    # inode and change time: a re-created socket may reuse the inode number
                    present[path] = (info.st_ino, info.st_ctime_ns)
            for path in list(self._sockets):
                if present.get(path) != self._sockets[path]:
                    del self._sockets[path]
                    for driver, plugin in list(self.plugins.items()):
                        if plugin.registration == path:
                            await self._drop(driver, schedule_wipe=True)
            for path, inode in present.items():
                if path not in self._sockets:
                    self._sockets[path] = inode
                    await self._register(path)
            await asyncio.sleep(self.scan_s)

    def _violation(self, text: str) -> None:
        self.violations.append(text)

    async def _register(self, path: Path) -> None:
        async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
            stub = reg_grpc.RegistrationStub(channel)
            started = time.perf_counter()
            try:
                info = await stub.GetInfo(reg.InfoRequest(), timeout=GETINFO_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                self._violation(f"{path.name}: GetInfo failed: {exc.code().name} {exc.details()}")
                return
            self.getinfo_seconds.append(time.perf_counter() - started)
            error = self._check_info(info)
            service = next((v for v in info.supported_versions if v in KNOWN_SERVICES), None)
            if error is None and service is None:
                error = (
                    f"none of the versions {list(info.supported_versions)} is supported by "
                    f"kubelet ({list(KNOWN_SERVICES)})"
                )
            if error is None and info.name in self.plugins:
                other = self.plugins[info.name]
                if other.endpoint == (info.endpoint or str(path)):
                    error = f"endpoint {other.endpoint} of {info.name} is already registered"
            if error is not None:
                self.refused.append(error)
                await stub.NotifyRegistrationStatus(
                    reg.RegistrationStatus(plugin_registered=False, error=error), timeout=5
                )
                return
            assert service is not None
            endpoint = info.endpoint or str(path)
            plugin = Plugin(
                driver=info.name,
                registration=path,
                endpoint=endpoint,
                service=service,
                channel=grpc.aio.insecure_channel(f"unix://{endpoint}"),
            )
            old = self.plugins.pop(info.name, None)
            if old is not None:
                await self._close(old)
            self.plugins[info.name] = plugin
            wipe = self._wipes.pop(info.name, None)
            if wipe is not None:
                wipe.cancel()
            try:
                await stub.NotifyRegistrationStatus(
                    reg.RegistrationStatus(plugin_registered=True), timeout=5
                )
            except grpc.aio.AioRpcError as exc:
                self._violation(f"{info.name}: NotifyRegistrationStatus failed: {exc.details()}")
                await self._drop(info.name, schedule_wipe=True)
                return
            self.registrations += 1
            plugin.health_task = asyncio.create_task(self._health(plugin))

    def _check_info(self, info: reg.PluginInfo) -> str | None:
        if info.type != "DRAPlugin":
            return f"no handler registered for plugin type: {info.type}"
        if not info.name:
            return "plugin name is empty"
        if info.endpoint and not info.endpoint.startswith("/"):
            return f"endpoint {info.endpoint!r} is not an absolute path"
        return None

    async def _health(self, plugin: Plugin) -> None:
        stub = health_grpc.DRAResourceHealthStub(plugin.channel)
        known: set[tuple[str, str]] = set()
        try:
            async for message in stub.NodeWatchResources(health.NodeWatchResourcesRequest()):
                listed = {(d.device.pool_name, d.device.device_name) for d in message.devices}
                if known - listed:
                    self._violation(f"health stream dropped devices {sorted(known - listed)}")
                known |= listed
                for device in message.devices:
                    if len(device.message) > 1024:
                        self._violation(f"health message over 1024 characters: {device.device}")
                plugin.health.append(message)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._violation(
                    f"{plugin.driver}: no health stream (kubelet logs an error every 5 s)"
                )

    async def _close(self, plugin: Plugin) -> None:
        if plugin.health_task is not None:
            plugin.health_task.cancel()
            with suppress(asyncio.CancelledError):
                await plugin.health_task
        await plugin.channel.close()

    async def _drop(self, driver: str, *, schedule_wipe: bool) -> None:
        plugin = self.plugins.pop(driver, None)
        if plugin is not None:
            await self._close(plugin)
        if schedule_wipe:
            loop = asyncio.get_running_loop()
            self._wipes[driver] = loop.call_later(
                self.wiping_delay_s, lambda: asyncio.ensure_future(self._wipe(driver))
            )

    async def _wipe(self, driver: str) -> None:
        self._wipes.pop(driver, None)
        if driver in self.plugins:
            return
        await call_json(
            self.api,
            "DELETE",
            RESOURCE_SLICES.path(),
            query=[("fieldSelector", f"spec.nodeName={self.node},spec.driver={driver}")],
        )
        self.wiped.append(f"{driver} unregistered")

    def registered(self, driver: str) -> bool:
        return driver in self.plugins

    async def wait_for(self, predicate: Any, within_s: float = 5.0) -> bool:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if predicate():
                return True
            await asyncio.sleep(0.01)
        return bool(predicate())

    # ---- the DRA manager -------------------------------------------------------------------

    def _stub(self, driver: str) -> dra_grpc.DRAPluginStub:
        plugin = self.plugins.get(driver)
        if plugin is None:
            raise PrepareFailed(f"DRA driver {driver} is not registered")
        return dra_grpc.DRAPluginStub(plugin.channel)

    async def prepare(
        self, driver: str, claims: list[ClaimKey], *, pod: dict[str, Any] | None = None
    ) -> dict[str, list[dra.Device]]:
        """Prepare a pod's claims of one driver; the devices (with CDI IDs) of each claim."""
        for claim in claims:
            obj = await call_json(
                self.api, "GET", RESOURCE_CLAIMS.path(claim.namespace, claim.name)
            )
            if obj["metadata"]["uid"] != claim.uid:
                raise PrepareFailed(f"ResourceClaim {claim.name} got replaced")
            if pod is not None:
                reserved = (obj.get("status") or {}).get("reservedFor") or []
                if not any(r.get("uid") == pod["metadata"]["uid"] for r in reserved):
                    raise PrepareFailed(
                        f"pod {pod['metadata']['name']} is not allowed to use ResourceClaim "
                        f"{claim.name}"
                    )
        todo = [c for c in claims if c.uid not in self.prepared]
        if todo:
            request = dra.NodePrepareResourcesRequest(
                claims=[dra.Claim(namespace=c.namespace, name=c.name, uid=c.uid) for c in todo]
            )
            response = await self._stub(driver).NodePrepareResources(
                request, timeout=CALL_TIMEOUT_S
            )
            self._check_answers("NodePrepareResources", todo, set(response.claims))
            errors = {uid: a.error for uid, a in response.claims.items() if a.error}
            for claim in todo:
                answer = response.claims[claim.uid]
                if answer.error:
                    continue
                for device in answer.devices:
                    if not device.pool_name or not device.device_name:
                        self._violation(f"claim {claim.uid}: device without pool or name")
                    for cdi_id in device.cdi_device_ids:
                        if not _CDI_ID.match(cdi_id):
                            self._violation(f"claim {claim.uid}: malformed CDI ID {cdi_id!r}")
                self.prepared[claim.uid] = (claim, list(answer.devices))
            if errors:
                raise PrepareFailed("; ".join(f"{uid}: {e}" for uid, e in sorted(errors.items())))
        return {c.uid: self.prepared[c.uid][1] for c in claims}

    async def unprepare(self, driver: str, claims: list[ClaimKey]) -> None:
        request = dra.NodeUnprepareResourcesRequest(
            claims=[dra.Claim(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]
        )
        response = await self._stub(driver).NodeUnprepareResources(request, timeout=CALL_TIMEOUT_S)
        self._check_answers("NodeUnprepareResources", claims, set(response.claims))
        errors = {uid: a.error for uid, a in response.claims.items() if a.error}
        for claim in claims:
            if claim.uid not in errors:
                self.prepared.pop(claim.uid, None)
        if errors:
            raise PrepareFailed("; ".join(f"{uid}: {e}" for uid, e in sorted(errors.items())))

    def _check_answers(self, rpc: str, claims: list[ClaimKey], answered: set[str]) -> None:
        asked = {c.uid for c in claims}
        if answered - asked:
            raise PrepareFailed(
                f"{rpc}: unknown claim UIDs in the answer: {sorted(answered - asked)}"
            )
        if asked - answered:
            raise PrepareFailed(f"{rpc}: skipped {len(asked - answered)} ResourceClaims")
