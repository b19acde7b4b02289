"""The running device plugin: NVML, health thread, gRPC endpoints, reconciler, HTTP, publisher.

Its concurrency model is threads: gRPC serves kubelet's calls on worker threads, NVML's event
wait and the guard's scans block, the reconciler sleeps between PodResources reads. Every call
to the API server (the Node's labels and allocatable, the guard's Events) goes through one
event-loop thread this daemon owns (``shared.apiloop.ApiLoop``), and so does every read of a
container's pod for its placement record (extender placement).
"""

from __future__ import annotations

import concurrent.futures
import logging
import signal
import threading
import time
from types import FrameType

from deviceplugin.classic.config import Config
from deviceplugin.classic.node import AllocatableMirror, NodePublisher
from deviceplugin.classic.plugin import DevicePlugin
from deviceplugin.classic.policies import PodPolicies
from deviceplugin.classic.records import api_reader
from deviceplugin.classic.service import Supervisor
from deviceplugin.shared import inventory
from deviceplugin.shared.apiloop import ApiLoop
from deviceplugin.shared.podresources import PodResourcesError
from deviceplugin.shared.services import GuardSource, NodeServices
from deviceplugin.shared.uninstall import UninstallWatch, Verdict, clean_up

log = logging.getLogger(__name__)


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.plugin: DevicePlugin | None = None
        self.services: NodeServices | None = None
        self.supervisor: Supervisor | None = None
        self.publisher: NodePublisher | None = None
        self.mirror: AllocatableMirror | None = None
        self.api: ApiLoop | None = None
        self.uninstall: UninstallWatch | None = None
        self._stop = threading.Event()
        self._reconciler: threading.Thread | None = None

    def start(self) -> None:
        config = self.config
        inventory.load_nvml(config.nvml_library)
        cards = inventory.discover()
        if config.node_name or config.daemonset:
            self.api = ApiLoop(config.kubeconfig)
            self.api.start()
        read_pod = None  # extender placement: containers' pods, for their placement records
        if config.placement == "extender" and self.api is not None:
            read_pod = api_reader(self.api.call, config.record_timeout_s)
        plugin = DevicePlugin(config, cards, read_pod=read_pod)
        self.plugin = plugin
        plugin.install_host_files()
        plugin.recover()
        plugin.checkpointer.start()
        plugin.start_verifier()
        if config.daemonset is not None and self.api is not None:
            watch = self.uninstall = UninstallWatch(
                config.daemonset, timeout_s=config.uninstall_timeout_s
            )
            self.api.submit(lambda: watch.run_with_client(config.kubeconfig))
        if config.node_name and self.api is not None:
            self.publisher = NodePublisher(config, cards, plugin.allocator, self.api)
            self.publisher.start()
            if config.node_allocatable:
                self.mirror = AllocatableMirror(
                    config,
                    plugin.allocator,
                    self.api,
                    registered=lambda: self.supervisor is not None and self.supervisor.registered,
                )
                self.mirror.start()
        self.services = NodeServices(
            config,
            cards,
            metrics=plugin.metrics.node,
            registry=plugin.metrics.registry,
            on_health=self._health_changed,
            registered=lambda: self.supervisor is not None and self.supervisor.registered,
            spawn=self.api.spawn if self.api is not None else None,
        )
        resources = set(plugin.resources.values())
        self.services.start(
            GuardSource(
                list_containers=lambda: plugin.podresources.list(resources),
                limits_dir=plugin.grant_dir,
                # Without an API server no pod can be read: every share is then a hard cap.
                policy_of=PodPolicies(self.api.spawn) if self.api is not None else None,
            )
        )
        self.supervisor = Supervisor(plugin)
        self.supervisor.start()
        self._reconciler = threading.Thread(target=self._reconcile, name="reconcile", daemon=True)
        self._reconciler.start()
        log.info("device plugin started", extra={"cards": len(cards)})

    def _health_changed(self, card: int, healthy: bool, reason: str) -> None:
        assert self.plugin is not None
        if self.plugin.allocator.set_health(card, healthy, reason) and self.publisher:
            self.publisher.poke()

    def _reconcile(self) -> None:
        """Read PodResources every interval; sooner while a missed container awaits the
        second listing that confirms it gone (its devices come back that much sooner)."""
        assert self.plugin is not None
        wait = self.config.reconcile_interval_s
        while not self._stop.wait(wait):
            wait = self.config.reconcile_interval_s
            try:
                with self.plugin.metrics.reconcile_seconds.time():
                    result = self.plugin.reconcile_once()
            except PodResourcesError as exc:
                log.warning("reconciliation skipped", extra={"error": str(exc)})
            except Exception:
                log.exception("reconciliation failed")
            else:
                if result.unconfirmed:
                    wait = min(wait, max(self.config.reconcile_confirm_s, 0.05))

    def healthz(self) -> tuple[bool, str]:
        return self.services.healthz() if self.services is not None else (False, "starting")

    def _uninstalled(self) -> Verdict | None:
        """Whether this stop is an uninstall (None: not asked, no --daemonset)."""
        if self.uninstall is None or self.api is None:
            return None
        # Two reads at most (its DaemonSet, the other agent's), each within the timeout.
        wait_s = 2 * self.config.uninstall_timeout_s + 1
        try:
            return self.api.submit(self.uninstall.decide).result(timeout=wait_s)
        except (concurrent.futures.TimeoutError, RuntimeError) as exc:
            return Verdict(None, True, f"no answer within {wait_s} s: {exc or type(exc).__name__}")

    def stop(self) -> None:
        self._stop.set()
        if self.mirror is not None:
            # Before the sockets go: no pod must be placed here while nothing serves them, and
            # one bound just before the withdrawal must still find the plugin serving.
            self.mirror.stop()
            if self.mirror.withdraw() and self.supervisor is not None:
                time.sleep(self.config.stop_drain_s)
        uninstalled = self._uninstalled()
        if self.services is not None:
            self.services.stop_http()
        if self.supervisor is not None:
            self.supervisor.stop()
        if self.services is not None:
            self.services.stop()
        if self.publisher is not None:
            self.publisher.stop()
        if self.api is not None:
            self.api.stop()
        if self._reconciler is not None:
            self._reconciler.join(timeout=5)
        if self.plugin is not None:
            self.plugin.stop_verifier()
            self.plugin.checkpointer.stop()
            running, idle = set[str](), None
            if uninstalled is not None:
                removing = uninstalled.uninstalled is True
                running = self.plugin.listed_dirs() if removing else self.plugin.running_dirs()
                idle = self.plugin.node_idle() if removing else None
            self.plugin.podresources.close()
            if uninstalled is not None:  # last: nothing of the plugin writes any more
                clean_up(uninstalled, self.plugin.host_files(), running, idle)
        inventory.shutdown_nvml()
        log.info("device plugin stopped")


def run(config: Config) -> int:
    """Run until SIGTERM or SIGINT; the exit status for the CLI."""
    daemon = Daemon(config)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        daemon.start()
    except inventory.InventoryError as exc:
        log.error("cannot start: no usable NVML", extra={"error": str(exc)})
        return 1
    stop.wait()
    daemon.stop()
    return 0


__all__ = ["Daemon", "run"]
