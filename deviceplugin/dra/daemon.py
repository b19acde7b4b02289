"""The running DRA plugin: NVML and its health thread, the API client, the ResourceSlice
publisher, the claim driver, the kubelet sockets, the reconciler and /metrics, on one event loop.

Its concurrency model is that one loop: every API call and every kubelet call is a task on it.
Only what blocks runs on threads, and hands its results to the loop: NVML's event wait (the
health monitor), the node guard's scans (NVML, /proc, PodResources) whose Events are posted as
tasks on the loop, and the HTTP endpoint.

Start order matters: the checkpoint is restored (and CDI specs rewritten) before kubelet can
call, and the sockets are served last, so a registered plugin is always ready to prepare.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from contextlib import AsyncExitStack, suppress
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from core.dra import DRIVER
from core.kube import RESOURCE_CLAIMS, Api, KubeConfigError, call_json, kube_client
from core.units import CORE, MEMORY
from deviceplugin.dra.claims import ClaimRef
from deviceplugin.dra.config import DraConfig
from deviceplugin.dra.driver import DraDriver
from deviceplugin.dra.metrics import DraMetrics
from deviceplugin.dra.service import CardBoard, PluginServers
from deviceplugin.dra.slices import CardState, SlicePublisher
from deviceplugin.dra.status import ClaimStatusWriter
from deviceplugin.shared import inventory
from deviceplugin.shared.apiloop import spawner_on
from deviceplugin.shared.hostfiles import read_policy
from deviceplugin.shared.podresources import PodResourcesClient, PodResourcesError
from deviceplugin.shared.services import GuardSource, NodeServices
from deviceplugin.shared.uninstall import UninstallWatch, Verdict, clean_up

log = logging.getLogger(__name__)
MERGE_PATCH = "application/merge-patch+json"


class DraDaemon:
    def __init__(self, config: DraConfig, *, metrics: DraMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or DraMetrics(CollectorRegistry())
        self.api: Api | None = None
        self.board: CardBoard | None = None
        self.driver: DraDriver | None = None
        self.publisher: SlicePublisher | None = None
        self.servers: PluginServers | None = None
        self.services: NodeServices | None = None
        self.podresources: PodResourcesClient | None = None
        self.status: ClaimStatusWriter | None = None
        self.uninstall: UninstallWatch | None = None
        self._stack = AsyncExitStack()
        # The loops that run until the stop (claim reconciliation, claim status, the uninstall
        # watch), children of one task group: the stop cancels them together and waits for them.
        self._background: asyncio.Task[None] | None = None

    async def _get_claim(self, ref: ClaimRef) -> dict[str, Any]:
        return await self._call("GET", RESOURCE_CLAIMS.path(ref.namespace, ref.name), None)

    async def _call(self, method: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        assert self.api is not None
        return await call_json(
            self.api,
            method,
            path,
            body=body,
            content_type=MERGE_PATCH if method == "PATCH" else "application/json",
            timeout_s=self.config.claim_timeout_s,
        )

    async def start(self) -> None:
        """Checkpoint and CDI specs first, so that kubelet finds every claim it prepared; then
        the slice, the node services, and the kubelet sockets last: a registered plugin is
        ready to prepare."""
        config = self.config
        inventory.load_nvml(config.nvml_library)
        cards = inventory.discover()
        self.board = board = CardBoard([CardState(c, inventory.details(c)) for c in cards])
        self.api = api = await self._stack.enter_async_context(kube_client(config.kubeconfig))
        if config.daemonset is not None:
            self.uninstall = UninstallWatch(config.daemonset, timeout_s=config.uninstall_timeout_s)
        self.driver = driver = DraDriver(config, cards, self._get_claim)
        driver.install_host_files()
        driver.restore()
        self.status = self._status_writer(driver, board)
        self.metrics.prepared.set(len(driver.prepared))
        await self._publish(api, board, inventory.driver_version())
        self._start_services(cards, board, api, driver)
        self.servers = PluginServers(config, driver, board, self.metrics)
        await self.servers.start()
        self._background = asyncio.create_task(self._run_background(), name="dra-background")
        log.info(
            "DRA plugin started",
            extra={"cards": len(cards), "driver": config.driver_name, "node": config.node},
        )

    def _status_writer(self, driver: DraDriver, board: CardBoard) -> ClaimStatusWriter:
        """What each prepared claim's status says of its devices, kept true as they change."""
        config = self.config
        status = ClaimStatusWriter(
            call=self._call,
            claims_path=lambda ref: RESOURCE_CLAIMS.path(ref.namespace, ref.name),
            driver=config.driver_name,
            node=config.node,
            health_of=board.health_of,
            on_write=lambda result: self.metrics.status_writes.labels(result).inc(),
        )
        driver.on_change = status.mark

        def mark_all() -> None:
            for prepared in driver.prepared.values():
                status.mark(prepared.ref, prepared.results)

        # A card's health changed; and after a restart, so that the entries say what this
        # plugin holds now.
        board.on_change(mark_all)
        mark_all()
        return status

    async def _publish(self, api: Api, board: CardBoard, version: str | None) -> None:
        self.publisher = SlicePublisher(
            api,
            node=self.config.node,
            driver=self.config.driver_name,
            states=board.states,
            driver_version=version,
            on_publish=lambda how: self.metrics.slice_writes.labels(how).inc(),
        )
        board.on_change(self.publisher.poke)
        board.on_change(
            lambda: self.metrics.unhealthy.set(sum(not s.healthy for s in board.states()))
        )
        await self.publisher.start()

    def _start_services(
        self, cards: list[inventory.Card], board: CardBoard, api: Api, driver: DraDriver
    ) -> None:
        config = self.config
        loop = asyncio.get_running_loop()

        def changed(card: int, healthy: bool, reason: str) -> None:  # on the health thread
            asyncio.run_coroutine_threadsafe(board.set_health(card, healthy, reason), loop)

        self.services = NodeServices(
            config,
            cards,
            metrics=self.metrics.node,
            registry=self.metrics.registry,
            on_health=changed,
            registered=lambda: self.servers is not None and self.servers.registration.registered,
            spawn=spawner_on(loop, api),
        )
        guard: GuardSource | None = None
        if config.guard.interval_s > 0:
            podresources = self.podresources = PodResourcesClient(
                config.podresources_path, config.podresources_timeout_s
            )
            guard = GuardSource(
                list_containers=lambda: podresources.list(set(), config.driver_name),
                limits_dir=driver.grant_dir,
                # The policy the claim's configuration gave, kept beside its limits at prepare.
                policy_of=lambda owner: read_policy(Path(owner.grant).parent),
            )
        self.services.start(guard)

    async def _run_background(self) -> None:
        assert self.api is not None
        async with asyncio.TaskGroup() as group:
            group.create_task(self._reconcile(), name="dra-reconcile")
            if self.status is not None:
                group.create_task(self.status.run(), name="dra-claim-status")
            if self.uninstall is not None:
                group.create_task(self.uninstall.run(self.api), name="dra-uninstall-watch")

    async def _reconcile(self) -> None:
        assert self.driver is not None
        while True:
            try:
                await self.driver.reconcile()
            except Exception:  # a bug here must not stop later passes
                log.exception("claim reconciliation failed")
            await asyncio.sleep(self.config.reconcile_interval_s)

    def healthz(self) -> tuple[bool, str]:
        if self.services is None:
            return False, "starting"
        if self._background is not None and self._background.done():
            return False, "a background loop ended (claim status, reconciliation, uninstall)"
        return self.services.healthz()

    async def stop(self) -> None:
        if self.services is not None:
            self.services.stop_http()
        if self._background is not None:
            self._background.cancel()
            with suppress(asyncio.CancelledError):
                await self._background
            self._background = None
        if self.servers is not None:
            await self.servers.stop()
        if self.services is not None:
            await asyncio.to_thread(self.services.stop)
        if self.publisher is not None:
            await self.publisher.stop()
        uninstalled = await self._uninstalled()
        idle: bool | None = None
        if self.podresources is not None:
            if uninstalled is not None and uninstalled.uninstalled:
                idle = await asyncio.to_thread(self._node_idle, self.podresources)
            self.podresources.close()
        await self._stack.aclose()
        inventory.shutdown_nvml()
        if uninstalled is not None and self.driver is not None:  # last: nothing writes any more
            clean_up(uninstalled, self.driver.host_files(), set(self.driver.prepared), idle)
        log.info("DRA plugin stopped")

    @staticmethod
    def _node_idle(podresources: PodResourcesClient) -> bool | None:
        """Kubelet lists no container holding a fracgpu share of either mode (the device
        plugin's resources, or a claim of fracgpu's driver); None when it cannot be asked."""
        try:
            return not podresources.list({CORE, MEMORY}, DRIVER)
        except PodResourcesError:
            return None

    async def _uninstalled(self) -> Verdict | None:
        """Whether this stop is an uninstall (None: not asked, no --daemonset)."""
        if self.uninstall is None:
            return None
        # Two reads at most (its DaemonSet, the other agent's), each within the timeout.
        wait_s = 2 * self.config.uninstall_timeout_s + 1
        try:
            return await asyncio.wait_for(self.uninstall.decide(), wait_s)
        except TimeoutError:
            return Verdict(None, True, f"no answer within {wait_s} s")


async def _main(config: DraConfig) -> int:
    daemon = DraDaemon(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await daemon.start()
    except inventory.InventoryError as exc:
        log.error("cannot start: no usable NVML", extra={"error": str(exc)})
        await daemon.stop()
        return 1
    except KubeConfigError as exc:
        log.error("cannot start: no cluster to talk to", extra={"error": str(exc)})
        await daemon.stop()
        return 1
    await stop.wait()
    await daemon.stop()
    return 0


def run(config: DraConfig) -> int:
    """Run until SIGTERM or SIGINT; the exit status for the CLI."""
    return asyncio.run(_main(config))


__all__ = ["DraDaemon", "run"]
