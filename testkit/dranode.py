"""A fake DRA-mode GPU node: fake NVML, the fake API server (with the Node and the DeviceClass),
the strict fake kubelet DRA side, and the real ``fracgpu dra-plugin`` daemon, on one event loop.

Everything lives in a short temporary directory (unix socket paths must stay under 108 bytes).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

from deviceplugin.dra.config import DraConfig
from deviceplugin.dra.daemon import DraDaemon
from testkit.apiserver import FakeApiServer
from testkit.drakubelet import ClaimKey, FakeDraKubelet
from testkit.draobjects import allocate_claim, canonicalize
from testkit.gpunode import cards as fake_cards
from testkit.kinds import RESOURCE_CLAIM
from testkit.nvml import FakeCard, FakeNvml, build_cached
from testkit.objectrules import now

DRIVER = "gpu.fracgpu.io"
NODE = "node-a"


def device_class(driver: str = DRIVER) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": driver},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]},
    }


def share_claim(
    name: str,
    *,
    cores: int | None = None,
    memory: str | None = None,
    count: int = 1,
    namespace: str = "default",
) -> dict[str, Any]:
    """A claim as the webhook (or a user) writes it: one request, ``count`` cards, a share."""
    exactly: dict[str, Any] = {"deviceClassName": DRIVER}
    if count != 1:
        exactly["count"] = count
    requests = {}
    if cores is not None:
        requests["cores"] = str(cores)
    if memory is not None:
        requests["memory"] = memory
    if requests:
        exactly["capacity"] = {"requests": requests}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }


class DraNode:
    def __init__(self, root: Path, api: FakeApiServer, cards: list[FakeCard]) -> None:
        self.root = root
        self.fake = api
        self.nvml = FakeNvml(root, cards)
        self.config = DraConfig(
            node_name=NODE,
            driver_name=DRIVER,
            kubeconfig=api.kubeconfig(root / "kubeconfig"),
            kubelet_root=root / "kl",
            cdi_root=root / "cdi",
            host_root=root / "host",
            nvml_library=build_cached(),
            metrics_port=0,
            health_wait_ms=50,
            health_probe_interval_s=0.1,
            health_quiet_s=0.3,
            health_resend_s=0.5,
            socket_check_s=0.05,
            reconcile_interval_s=3600.0,
        )
        self.daemon: DraDaemon | None = None
        self.kubelet: FakeDraKubelet | None = None
        self.api: Any = None

    async def start_plugin(self, **overrides: Any) -> DraDaemon:
        os.environ.update(self.nvml.env())
        config = dataclasses.replace(self.config, **overrides) if overrides else self.config
        self.daemon = DraDaemon(config)
        await self.daemon.start()
        return self.daemon

    async def stop_plugin(self) -> None:
        if self.daemon is not None:
            await self.daemon.stop()
            self.daemon = None

    @property
    def plugin(self) -> DraDaemon:
        assert self.daemon is not None
        return self.daemon

    async def wait_registered(self, within_s: float = 5.0) -> bool:
        assert self.kubelet is not None
        kubelet = self.kubelet
        return await kubelet.wait_for(lambda: kubelet.registered(DRIVER), within_s)

    def slices(self) -> list[dict[str, Any]]:
        return [
            s
            for s in self.fake.objects("resourceslices")
            if s["spec"].get("nodeName") == NODE and s["spec"]["driver"] == DRIVER
        ]

    async def wait_slice(self, predicate: Any = None, within_s: float = 5.0) -> dict[str, Any]:
        assert self.kubelet is not None

        def ready() -> bool:
            found = self.slices()
            return len(found) == 1 and (predicate is None or bool(predicate(found[0])))

        assert await self.kubelet.wait_for(ready, within_s), f"slices now: {self.slices()}"
        return self.slices()[0]

    def create_claim(self, claim: dict[str, Any]) -> dict[str, Any]:
        # As the API server stores it (canonical quantities), so that later writes through the
        # API (the plugin's status) find the spec they would have found.
        stored = copy.deepcopy(claim)
        canonicalize(RESOURCE_CLAIM, stored, now())
        return self.fake.put(stored)

    def allocate(self, name: str, namespace: str = "default", pod: Any = None) -> dict[str, Any]:
        return allocate_claim(self.fake.store, namespace, name, pod=pod)

    @staticmethod
    def key(claim: dict[str, Any]) -> ClaimKey:
        meta = claim["metadata"]
        return ClaimKey(meta["namespace"], meta["name"], meta["uid"])


@asynccontextmanager
async def dra_node(
    count: int = 2, memory_mib: int = 81559, *, start: bool = True, **kubelet: Any
) -> AsyncIterator[DraNode]:
    root = Path(tempfile.mkdtemp(prefix="fd", dir="/tmp"))
    async with AsyncExitStack() as stack:
        fake = await stack.enter_async_context(FakeApiServer())
        fake.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        fake.put(device_class())
        node = DraNode(root, fake, fake_cards(count, memory_mib))
        node.api = await stack.enter_async_context(fake.api_client())
        node.kubelet = FakeDraKubelet(root / "kl", NODE, node.api, **kubelet)
        try:
            await node.kubelet.start()
            if start:
                await node.start_plugin()
                assert await node.wait_registered(), f"refused: {node.kubelet.refused}"
                await node.wait_slice()  # claims are allocated against it
            yield node
        finally:
            await node.stop_plugin()
            await node.kubelet.stop()
            for key in node.nvml.env():
                os.environ.pop(key, None)
            shutil.rmtree(root, ignore_errors=True)
