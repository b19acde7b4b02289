"""A fake GPU node for device plugin tests: fake NVML + strict FakeKubelet + the real plugin.

Everything lives in a short temporary directory (unix socket paths must stay under 108 bytes).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from deviceplugin.classic.config import Config
from deviceplugin.classic.daemon import Daemon
from testkit.kubelet import FakeKubelet
from testkit.nvml import FakeCard, FakeNvml, build_cached

GIB = 1024


def cards(count: int, memory_mib: int = 24 * GIB, *, numa_nodes: int = 1) -> list[FakeCard]:
    per_node = max(count // numa_nodes, 1)
    return [
        FakeCard(
            uuid=f"GPU-{i:08x}-fake-4000-8000-{i:012x}",
            memory_mib=memory_mib,
            minor=i,
            numa=i // per_node if numa_nodes > 1 else -1,
        )
        for i in range(count)
    ]


class GpuNode:
    def __init__(self, root: Path, fake_cards: list[FakeCard], **config: Any) -> None:
        self.root = root
        self.nvml = FakeNvml(root, fake_cards)
        self.kubelet = FakeKubelet(root / "dp", root / "pr" / "kubelet.sock")
        defaults: dict[str, Any] = {
            "plugin_dir": root / "dp",
            "podresources_socket": root / "pr" / "kubelet.sock",
            "host_root": root / "host",
            "dev_root": Path("/dev"),
            "cdi_root": root / "cdi",
            "nvml_library": build_cached(),
            "metrics_port": 0,
            "watch_interval_s": 0.05,
            "reconcile_interval_s": 3600.0,
            "reconcile_grace_s": 0.0,
            "reconcile_confirm_s": 0.0,  # tests of the confirmation set their own
            "kubelet_settle_s": 0.0,  # the fake kubelet's socket is as young as the test
            "register_timeout_s": 5.0,
            "health_wait_ms": 50,
            "health_probe_interval_s": 0.1,
            "health_quiet_s": 0.3,
            "health_error_backoff_s": 0.05,
        }
        defaults.update(config)
        self.config = Config(**defaults)
        self.daemon: Daemon | None = None

    def start_plugin(self, **overrides: Any) -> Daemon:
        os.environ.update(self.nvml.env())
        config = dataclasses.replace(self.config, **overrides) if overrides else self.config
        self.daemon = Daemon(config)
        self.daemon.start()
        return self.daemon

    def stop_plugin(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None

    @property
    def plugin(self) -> Any:
        assert self.daemon is not None and self.daemon.plugin is not None
        return self.daemon.plugin

    def wait_registered(self, timeout: float = 5.0) -> bool:
        names = (self.config.core_resource, self.config.memory_resource)
        return self.kubelet.wait_for(lambda: self.kubelet.registered(*names), timeout)


@contextmanager
def gpu_node(fake_cards: list[FakeCard], *, start: bool = True, **config: Any) -> Iterator[GpuNode]:
    root = Path(tempfile.mkdtemp(prefix="fg", dir="/tmp"))
    node = GpuNode(root, fake_cards, **config)
    try:
        node.kubelet.start()
        if start:
            node.start_plugin()
            assert node.wait_registered(), "plugin did not register"
        yield node
    finally:
        node.stop_plugin()
        node.kubelet.stop()
        for key in node.nvml.env():
            os.environ.pop(key, None)
        shutil.rmtree(root, ignore_errors=True)
