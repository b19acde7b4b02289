"""/metrics and /healthz of a running plugin."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

from testkit.gpunode import cards, gpu_node
from testkit.kubelet import Container, Pod
from tests.support import free_port


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_metrics_and_health() -> None:
    port = free_port()
    with gpu_node(cards(2), metrics_address="127.0.0.1", metrics_port=port) as node:
        # kubelet records the registration as its Register call returns, the plugin a moment
        # later: healthy within that moment, not at the same instant.
        deadline = time.monotonic() + 5
        while get(port, "/healthz")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert get(port, "/healthz") == (200, "ok\n")
        pod = Pod("default", "m", [Container("c", {"fracgpu.io/core": 30, "fracgpu.io/memory": 8})])
        node.kubelet.admit(pod)
        node.nvml.xid(1, 79)
        assert node.kubelet.wait_for(lambda: node.kubelet.allocatable("fracgpu.io/core") == 100)
        status, text = get(port, "/metrics")
        assert status == 200
        lines = set(text.splitlines())
        uuid0 = "GPU-00000000-fake-4000-8000-000000000000"
        uuid1 = "GPU-00000001-fake-4000-8000-000000000001"
        assert f'fracgpu_device_plugin_card_core_allocated{{card="0",uuid="{uuid0}"}} 30.0' in lines
        assert (
            f'fracgpu_device_plugin_card_memory_blocks_allocated{{card="0",uuid="{uuid0}"}} 8.0'
            in lines
        )
        assert f'fracgpu_device_plugin_card_healthy{{card="1",uuid="{uuid1}"}} 0.0' in lines
        assert 'fracgpu_device_plugin_registered{resource="fracgpu.io/core"} 1.0' in lines
        assert 'fracgpu_device_plugin_allocations_total{resource="fracgpu.io/memory"} 1.0' in lines
        assert 'fracgpu_device_plugin_health_events_total{card="1",reason="XID 79"} 1.0' in lines
        assert get(port, "/nope")[0] == 404


def test_health_fails_until_registered() -> None:
    port = free_port()
    with gpu_node(cards(1), start=False, metrics_address="127.0.0.1", metrics_port=port) as node:
        node.kubelet.stop()  # no kubelet.sock: nothing to register with
        node.start_plugin()
        assert get(port, "/healthz") == (503, "not registered with kubelet\n")
        node.kubelet.start()
        assert node.wait_registered()
        assert get(port, "/healthz") == (200, "ok\n")
