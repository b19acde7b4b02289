"""The guard's Events, posted by the real client to the strict fake API server."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from core.contract import Limits
from deviceplugin.classic.config import Config
from deviceplugin.shared.apiloop import ApiLoop, spawner_on
from deviceplugin.shared.guardevents import REASON_EXCESS, REASON_KILLED, EventReporter
from deviceplugin.shared.guardtypes import Owner
from deviceplugin.shared.inventory import Card
from deviceplugin.shared.settings import GuardSettings
from testkit.apiserver import FakeApiServer
from testkit.gpunode import cards, gpu_node
from testkit.kubelet import Container, Pod
from testkit.nodeproc import NodeProc, container

CORE, MEMORY = Config().core_resource, Config().memory_resource

CARD = Card(0, "GPU-a", "NVIDIA A100-SXM4-80GB", 81920, 0, None)
OWNER = Owner(
    "team-a",
    "train-0",
    "main",
    "6f1c2a8e-1b2c-4d5e-8f90-0123456789ab",
    "0f" * 32,
    Limits(("GPU-a",), 2**30, 50),
)


async def _until(predicate: Any, seconds: float = 5.0) -> bool:
    for _ in range(int(seconds / 0.02)):
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return bool(predicate())


@pytest.mark.parametrize("spawner", ["api-loop-thread", "agent-loop"])
@pytest.mark.parametrize(
    "case",
    [
        pytest.param((True, "excess", REASON_EXCESS, "killed in 1 s"), id="excess-then-kill"),
        pytest.param((False, "excess", REASON_EXCESS, "reports only"), id="excess-report-only"),
        pytest.param((True, "killed", REASON_KILLED, "killed process 4242"), id="killed"),
    ],
)
async def test_event_on_the_pod(
    case: tuple[bool, str, str, str], spawner: str, tmp_path: Path
) -> None:
    """Either agent's way to the API server: the classic agent's own loop thread, or the loop
    the DRA agent already runs (the guard calls from its thread in both)."""
    kill, action, reason, says = case
    async with FakeApiServer() as fake, fake.api_client() as api:
        fake.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a"}})
        loop = ApiLoop(fake.kubeconfig(tmp_path / "kubeconfig"))
        if spawner == "api-loop-thread":
            loop.start()
            reporter = EventReporter("gpu-1", loop.spawn, kill=kill)
        else:
            reporter = EventReporter(
                "gpu-1", spawner_on(asyncio.get_running_loop(), api), kill=kill
            )
        try:
            if action == "excess":
                reporter.excess(OWNER, CARD, 3 * 2**30, 2**30 + 2**29, 1.0)
            else:
                reporter.killed(OWNER, CARD, 4242, 3 * 2**30, 2**30 + 2**29)
            assert await _until(lambda: reporter.posted == 1)
        finally:
            await asyncio.to_thread(loop.stop)
        (event,) = fake.objects("events", "team-a")
        assert event["reason"] == reason
        assert event["type"] == "Warning"
        assert event["involvedObject"] == {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": "train-0",
            "namespace": "team-a",
            "uid": OWNER.pod_uid,
            "fieldPath": "spec.containers{main}",
        }
        assert says in event["message"]
        assert "3072 MiB of card 0 (GPU-a)" in event["message"]
        assert "1536 MiB" in event["message"]
        assert event["source"] == {"component": "fracgpu-device-plugin", "host": "gpu-1"}


async def test_api_server_refusal_is_logged_not_raised(tmp_path: Path) -> None:
    async with FakeApiServer() as fake:
        fake.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a"}})
        loop = ApiLoop(fake.kubeconfig(tmp_path / "kubeconfig"))
        reporter = EventReporter("gpu-1", loop.spawn, kill=True)
        fake.down("503", seconds=1.0)
        loop.start()
        try:
            reporter.excess(OWNER, CARD, 3 * 2**30, 2**30, 1.0)
            await asyncio.sleep(0.3)
            reporter.killed(OWNER, CARD, 1, 3 * 2**30, 2**30)
            await asyncio.sleep(1.0)
            reporter.killed(OWNER, CARD, 2, 3 * 2**30, 2**30)
            assert await _until(lambda: reporter.posted == 1)
            assert reporter.failed == 2
        finally:
            await asyncio.to_thread(loop.stop)
        assert [e["message"].split(",")[0] for e in fake.objects("events", "team-a")] == [
            "killed process 2 of container main"
        ]


async def test_daemon_posts_the_guards_events(tmp_path: Path) -> None:
    """The plugin with --node-name: its guard's excess and kill reach the pod as Events."""
    async with FakeApiServer() as fake:
        fake.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-1"}})
        fake.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a"}})
        kubeconfig = fake.kubeconfig(tmp_path / "kubeconfig")
        target = container("team-a", "train-0", "main")

        def run_node() -> int:
            procs = NodeProc(tmp_path / "node")
            try:
                with gpu_node(
                    cards(1, 8192),
                    node_name="gpu-1",
                    kubeconfig=kubeconfig,
                    guard=GuardSettings(
                        interval_s=0.05,
                        grace_s=0.1,
                        process_overhead_mib=0,
                        proc_root=procs.proc,
                        container_logs=procs.logs,
                    ),
                ) as gpu:
                    pod = Pod("team-a", "train-0", [Container("main", {CORE: 50, MEMORY: 4})])
                    gpu.kubelet.admit(pod)
                    gpu.kubelet.start_container(pod, "main")
                    child = procs.spawn()
                    procs.enter(child.pid, target)
                    gpu.nvml.process(0, child.pid, 2048)
                    returncode = child.wait(timeout=10)
                    assert gpu.daemon is not None
                    assert (
                        gpu.daemon.services is not None and gpu.daemon.services.events is not None
                    )
                    events = gpu.daemon.services.events
                    deadline = time.monotonic() + 5
                    while events.posted < 2 and time.monotonic() < deadline:
                        time.sleep(0.02)
                    return returncode
            finally:
                procs.close()

        assert await asyncio.to_thread(run_node) == -signal.SIGKILL
        posted = fake.objects("events", "team-a")
        assert sorted(e["reason"] for e in posted) == [REASON_EXCESS, REASON_KILLED]
        assert {e["involvedObject"]["uid"] for e in posted} == {target.pod_uid}
