"""The inventory follows the cluster's Nodes through the real client and the fake API server."""

from __future__ import annotations

from typing import Any

from testkit.apiserver import FakeApiServer
from tests.support import eventually
from webhook.gpumodels import GpuModel
from webhook.inventory import Inventory
from webhook.nodewatch import node_informer


def node(name: str, **labels: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}


GPU = {"fracgpu.io/gpu.product": "NVIDIA-L4", "fracgpu.io/gpu.memory-mib": "23034"}


async def test_inventory_follows_nodes_across_a_410_relist() -> None:
    async with FakeApiServer() as fake, fake.api_client() as api:
        fake.put(node("gpu-1", **GPU))
        fake.put(node("cpu-1"))
        inventory = Inventory()
        async with node_informer(api, inventory) as informer:
            await informer.wait_synced(5)
            assert inventory.models() == {"NVIDIA-L4": GpuModel("NVIDIA-L4", 23034)}
            fake.put(
                node(
                    "gpu-2", **{"nvidia.com/gpu.product": "A100", "nvidia.com/gpu.memory": "40960"}
                )
            )
            await eventually(lambda: "A100" in inventory.models())
            # While the watch is down, a node goes away and history is compacted: the informer
            # must relist and forget it.
            fake.drop_watches()
            fake.remove("nodes", "gpu-1")
            fake.compact()
            await eventually(lambda: "NVIDIA-L4" not in inventory.models())
            assert set(inventory.models()) == {"A100"}
