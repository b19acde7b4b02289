"""The device plugin against the strict FakeKubelet and the fake NVML, over real gRPC sockets."""

from __future__ import annotations

import json
import logging
import random
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from core import contract
from deviceplugin._proto import deviceplugin_v1beta1_pb2 as pb
from deviceplugin._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from deviceplugin.classic.allocation import container_dir_name
from deviceplugin.classic.allocator import Allocator
from deviceplugin.classic.config import Config
from deviceplugin.classic.ids import Kind, core_id, memory_id
from deviceplugin.classic.service import MAX_STREAMS, DevicePluginServicer
from deviceplugin.shared.inventory import Card
from testkit.gpunode import GIB, GpuNode, cards, gpu_node
from testkit.kubelet import AdmissionError, Container, Pod, PreStartFailed

CORE = "fracgpu.io/core"
MEMORY = "fracgpu.io/memory"


def pod(name: str, *containers: tuple[int, int]) -> Pod:
    return Pod(
        "default",
        name,
        [Container(f"c{i}", {CORE: c, MEMORY: m}) for i, (c, m) in enumerate(containers)],
    )


def card_of(node: GpuNode, ids: list[str]) -> set[int]:
    """The cards the plugin placed the container holding ``ids`` on (IDs name no card)."""
    kind = Kind.CORE if "-c" in ids[0] else Kind.MEMORY
    allocation = node.plugin.allocator.find(kind, ids)
    assert allocation is not None, ids[:3]
    return set(allocation.cards)


def cdi_edits(node: GpuNode, core: list[str]) -> dict[str, Any]:
    """The container edits of the CDI device PreStartContainer wrote for a container."""
    name = container_dir_name(core)
    spec = json.loads((node.config.cdi_root / f"fracgpu.io-container_{name}.json").read_text())
    assert spec["kind"] == "fracgpu.io/container"
    (device,) = spec["devices"]
    assert device["name"] == name
    edits: dict[str, Any] = device["containerEdits"]
    return edits


def limits_of(node: GpuNode, core: list[str]) -> contract.Limits:
    path = node.config.containers_dir / container_dir_name(core) / "limits" / "limits"
    return contract.Limits.parse(path.read_text())


def run(node: GpuNode, p: Pod) -> dict[str, dict[str, list[str]]]:
    held = node.kubelet.admit(p)
    for container in p.containers:
        node.kubelet.start_container(p, container.name)
    return held


def test_registers_both_resources_after_serving_and_advertises_every_id() -> None:
    with gpu_node(cards(2, 24 * GIB)) as node:
        kubelet = node.kubelet
        names = sorted(r.resource_name for r in kubelet.register_calls)
        assert names == [CORE, MEMORY]
        assert all(r.version == "v1beta1" for r in kubelet.register_calls)
        assert all(r.options.pre_start_required for r in kubelet.register_calls)
        assert kubelet.capacity(CORE) == 200
        assert kubelet.capacity(MEMORY) == 2 * 96
        assert kubelet.allocatable(CORE) == 200
        assert not kubelet.violations


def test_allocate_answers_with_card_devices_and_mounts_and_prestart_writes_limits() -> None:
    with gpu_node(cards(2, 24 * GIB)) as node:
        p = pod("one", (30, 20))
        held = run(node, p)["c0"]
        (card,) = card_of(node, held[CORE])
        assert card_of(node, held[MEMORY]) == {card}
        answer = node.kubelet.responses[p.key]["c0"][CORE]
        uuid = f"GPU-{card:08x}-fake-4000-8000-{card:012x}"
        # The card is named by a device-list mount, not by the variable (which a user could set).
        assert answer.envs["NVIDIA_VISIBLE_DEVICES"] == contract.DEVICE_LIST_MOUNT_ROOT
        assert "FRACGPU_MEMORY_MIB" not in answer.envs  # a share: admission set it
        assert [d.container_path for d in answer.devices] == [
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            "/dev/nvidia-uvm-tools",
        ]
        # The card itself comes through the CDI device, whose spec PreStartContainer wrote.
        name = container_dir_name(held[CORE])
        assert [d.name for d in answer.cdi_devices] == [f"fracgpu.io/container={name}"]
        edits = cdi_edits(node, held[CORE])
        assert edits["deviceNodes"] == [
            {"path": f"/dev/nvidia{card}", "hostPath": f"/dev/nvidia{card}"}
        ]
        (device_list,) = edits["mounts"]
        assert device_list["containerPath"] == f"{contract.DEVICE_LIST_MOUNT_ROOT}/{uuid}"
        assert device_list["hostPath"] == contract.DEVICE_LIST_HOST_PATH
        assert "ro" in device_list["options"]
        assert "env" not in edits
        mounts = {m.container_path: m for m in answer.mounts}
        assert not any(m.startswith(contract.DEVICE_LIST_MOUNT_ROOT) for m in mounts)
        assert mounts[contract.CONTAINER_HOOK_LIBRARY].read_only
        assert mounts[contract.LD_SO_PRELOAD].read_only
        assert mounts[contract.CONTAINER_LIMITS_DIR].read_only
        assert not mounts[contract.CONTAINER_SHARED_DIR].read_only
        assert Path(mounts[contract.CONTAINER_SHARED_DIR].host_path).is_dir()
        preload = Path(mounts[contract.LD_SO_PRELOAD].host_path).read_text()
        assert preload.strip() == contract.CONTAINER_HOOK_LIBRARY
        limits = limits_of(node, held[CORE])
        assert limits == contract.Limits((uuid,), 20 * 256 * 2**20, 30)
        host_limits = Path(mounts[contract.CONTAINER_LIMITS_DIR].host_path) / "limits"
        assert host_limits.read_text() == limits.render()
        assert node.kubelet.responses[p.key]["c0"][MEMORY] == pb.ContainerAllocateResponse()


def test_without_cdi_the_answer_that_completes_a_container_names_its_card() -> None:
    with gpu_node(cards(2, 24 * GIB), cdi_root=None) as node:
        p = pod("one", (30, 20))
        held = run(node, p)["c0"]
        (card,) = card_of(node, held[CORE])
        answers = node.kubelet.responses[p.key]["c0"]
        full = [a for a in answers.values() if a != pb.ContainerAllocateResponse()]
        assert len(full) == 1  # the second call's answer, whichever resource came second
        (answer,) = full
        assert not answer.cdi_devices
        assert f"/dev/nvidia{card}" in [d.container_path for d in answer.devices]
        uuid = f"GPU-{card:08x}-fake-4000-8000-{card:012x}"
        assert f"{contract.DEVICE_LIST_MOUNT_ROOT}/{uuid}" in [
            m.container_path for m in answer.mounts
        ]
        assert limits_of(node, held[CORE]).devices == (uuid,)
        assert not list(node.root.joinpath("cdi").glob("*"))


def test_prestart_is_idempotent_on_container_restart() -> None:
    with gpu_node(cards(1)) as node:
        p = pod("restarts", (50, 40))
        held = run(node, p)["c0"]
        first = limits_of(node, held[CORE])
        for _ in range(3):
            node.kubelet.start_container(p, "c0")
        assert limits_of(node, held[CORE]) == first
        assert len(node.plugin.allocator.allocations()) == 1


def test_two_containers_with_identical_requests_get_their_own_limits() -> None:
    with gpu_node(cards(1)) as node:
        a, b = pod("a", (40, 30)), pod("b", (40, 30))
        held_a = node.kubelet.admit(a)["c0"]
        held_b = node.kubelet.admit(b)["c0"]
        # Both are pending; they start in the reverse order of admission.
        node.kubelet.start_container(b, "c0")
        node.kubelet.start_container(a, "c0")
        dir_a = container_dir_name(held_a[CORE])
        dir_b = container_dir_name(held_b[CORE])
        assert dir_a != dir_b
        mounts_a = {
            m.container_path: m.host_path for m in node.kubelet.responses[a.key]["c0"][CORE].mounts
        }
        assert dir_a in mounts_a[contract.CONTAINER_LIMITS_DIR]
        assert limits_of(node, held_a[CORE]).compute_percent == 40
        assert limits_of(node, held_b[CORE]).compute_percent == 40
        assert not set(held_a[CORE]) & set(held_b[CORE])


def test_multi_container_pod_each_container_on_one_card() -> None:
    with gpu_node(cards(2)) as node:
        p = pod("multi", (60, 50), (60, 50), (20, 10))
        held = run(node, p)
        for name in ("c0", "c1", "c2"):
            assert len(card_of(node, held[name][CORE])) == 1, name
            assert limits_of(node, held[name][CORE]).compute_percent == len(held[name][CORE])
        assert card_of(node, held["c0"][CORE]) != card_of(node, held["c1"][CORE])


def test_whole_cards_use_one_numa_node_and_get_all_memory() -> None:
    with gpu_node(cards(8, 80 * GIB, numa_nodes=2)) as node:
        run(node, pod("small", (30, 30)))  # lands on card 0, NUMA node 0
        held = run(node, pod("big", (400, 4 * 320)))["c0"]
        assert card_of(node, held[CORE]) == {4, 5, 6, 7}
        limits = limits_of(node, held[CORE])
        assert len(limits.devices) == 4
        assert limits.memory_bytes == 80 * GIB * 2**20
        assert limits.compute_percent == 100


def test_eight_card_node_packs_fractions_and_keeps_whole_cards_whole() -> None:
    with gpu_node(cards(8, 80 * GIB)) as node:
        used: set[int] = set()
        for i in range(10):
            held = run(node, pod(f"frac{i}", (25, 80)))["c0"]
            used |= card_of(node, held[CORE])
        assert len(used) == 3  # 10 quarter cards fill 2.5 cards, not 8
        held = run(node, pod("whole", (500, 5 * 320)))["c0"]
        assert len(card_of(node, held[CORE])) == 5
        assert not card_of(node, held[CORE]) & used
        assert not node.kubelet.violations


def test_honest_arithmetic_strands_memory_of_a_card_without_core() -> None:
    with gpu_node(cards(1, 24 * GIB)) as node:
        kubelet = node.kubelet
        run(node, pod("cores", (100, 10)))
        assert kubelet.wait_for(lambda: kubelet.allocatable(MEMORY) == 10)
        assert kubelet.free(MEMORY) == set()
        with pytest.raises(AdmissionError, match="available 0"):
            kubelet.admit(pod("late", (1, 1)))


# (case, cards, containers already running, the pod that comes next, whether it fits one card)
MULTI_CARD = [
    pytest.param(2, [(60, 40), (60, 40)], (50, 20), False, id="two cards 0.6 used, 0.5 pod"),
    pytest.param(
        4, [(60, 40)] * 4, (50, 20), False, id="four cards 0.6 used, 0.5 pod (seen on a cluster)"
    ),
    pytest.param(4, [(60, 40)] * 4, (40, 20), True, id="four cards 0.6 used, 0.4 pod"),
    pytest.param(3, [(60, 40), (60, 40)], (50, 20), True, id="a whole free card takes it"),
    pytest.param(3, [(30, 10)], (200, 192), True, id="two whole cards beside a share"),
    pytest.param(3, [(60, 40), (60, 40)], (200, 192), False, id="two whole cards, one is free"),
]


@pytest.mark.parametrize(("count", "running", "incoming", "fits"), MULTI_CARD)
def test_a_multi_card_node_advertises_only_what_one_card_can_host(
    count: int, running: list[tuple[int, int]], incoming: tuple[int, int], fits: bool
) -> None:
    """A pod the scheduler would place is one that Allocate accepts, and the reverse: what
    a node advertises beyond its allocated IDs fits one card (or k whole free cards)."""
    with gpu_node(cards(count)) as node:
        kubelet = node.kubelet
        for i, share in enumerate(running):
            # one card each: the scheduler's arithmetic alone could put two on one card
            held = run(node, pod(f"r{i}", share))["c0"]
            assert len(card_of(node, held[CORE])) == 1
        nxt = pod("next", incoming)
        assert kubelet.wait_for(lambda: kubelet.schedulable(nxt) is fits)
        if fits:
            held = run(node, nxt)["c0"]
            assert card_of(node, held[CORE])
        else:
            with pytest.raises(AdmissionError, match="available"):
                kubelet.admit(nxt)
        assert not kubelet.violations


def test_a_pod_placed_on_capacity_an_ended_pod_freed_is_allocated_before_reconciliation() -> None:
    """Four cards 0.6 used each, one of those pods ends, and at once the scheduler places a
    0.5 pod there (it sees the ended pod's share free): kubelet offers the ended pod's IDs, and
    the plugin, which has not read PodResources since, takes kubelet's word and puts the pod on
    that card instead of refusing it (the cluster saw UnexpectedAdmissionError here)."""
    with gpu_node(cards(4), reconcile_interval_s=60.0) as node:  # no reading in between
        kubelet = node.kubelet
        running = [pod(f"r{i}", (60, 40)) for i in range(4)]
        held = [run(node, p)["c0"] for p in running]
        kubelet.remove(running[1])
        nxt = pod("next", (50, 20))
        assert kubelet.schedulable(nxt)
        got = run(node, nxt)["c0"]
        assert card_of(node, got[CORE]) == {1}  # where the ended pod was
        assert held[1][CORE]
        assert not kubelet.violations


def test_kubelet_restart_reregisters_within_two_seconds_and_keeps_allocations() -> None:
    with gpu_node(cards(2)) as node:
        kubelet = node.kubelet
        held = run(node, pod("survivor", (30, 20)))["c0"]
        registrations = len(kubelet.register_calls)
        kubelet.restart()  # latency: bench/deviceplugin.py measures it (target < 2 s)
        assert node.wait_registered(timeout=10.0)
        assert len(kubelet.register_calls) == registrations + 2
        assert kubelet.allocatable(CORE) == 200
        kubelet.start_container(pod("survivor", (30, 20)), "c0")  # PreStart after restart
        assert limits_of(node, held[CORE]).compute_percent == 30
        run(node, pod("after", (30, 20)))


def test_plugin_restart_recovers_allocations_from_checkpoint_and_podresources() -> None:
    with gpu_node(cards(1, 4 * GIB)) as node:  # 16 blocks
        kubelet = node.kubelet
        keep = pod("keep", (50, 8))
        held = run(node, keep)["c0"]
        gone = pod("gone", (20, 4))
        gone_held = run(node, gone)["c0"]
        node.stop_plugin()
        kubelet.remove(gone)  # the pod ended while the plugin was down
        node.start_plugin()
        assert node.wait_registered()
        allocations = node.plugin.allocator.allocations()
        assert [set(a.core) for a in allocations] == [set(held[CORE])]
        assert not (node.config.containers_dir / container_dir_name(gone_held[CORE])).exists()
        assert limits_of(node, held[CORE]).compute_percent == 50
        # Honesty survives the restart: 50 core and 8 blocks are left, and no more.
        late = run(node, pod("late", (50, 8)))["c0"]
        assert len(late[CORE]) == 50
        assert kubelet.wait_for(
            lambda: kubelet.free(CORE) == set() and kubelet.free(MEMORY) == set()
        )


def test_plugin_restart_without_checkpoint_adopts_from_podresources() -> None:
    with gpu_node(cards(1)) as node:
        held = run(node, pod("keep", (70, 10)))["c0"]
        node.stop_plugin()
        node.config.checkpoint_path.unlink()
        node.start_plugin()
        assert node.wait_registered()
        assert {frozenset(a.core) for a in node.plugin.allocator.allocations()} == {
            frozenset(held[CORE])
        }


def test_health_event_marks_card_unhealthy_within_a_second_and_recovers() -> None:
    with gpu_node(cards(2), health_quiet_s=2.0) as node:
        kubelet = node.kubelet
        node.nvml.xid(1, 79)  # latency: bench/deviceplugin.py measures it (target < 1 s)
        assert kubelet.wait_for(lambda: kubelet.allocatable(CORE) == 100, timeout=10.0)
        assert kubelet.wait_for(lambda: kubelet.allocatable(MEMORY) == 96, timeout=10.0)
        assert not any(i.startswith("g1-") for i in kubelet.healthy(MEMORY))
        assert kubelet.wait_for(lambda: kubelet.allocatable(CORE) == 200, timeout=10.0)


def test_application_xids_leave_the_card_healthy() -> None:
    with gpu_node(cards(1)) as node:
        kubelet = node.kubelet
        for xid in (13, 31, 43, 45, 68):
            node.nvml.xid(0, xid)
        node.nvml.double_bit_ecc(0)  # the marker: everything before it was read and ignored
        assert kubelet.wait_for(lambda: kubelet.allocatable(CORE) == 0, timeout=10.0)
        reasons = {u.reason for u in node.plugin.allocator.usage()}
        assert reasons == {"double-bit ECC error"}


def test_lost_card_is_unhealthy_until_it_answers_again() -> None:
    with gpu_node(cards(2)) as node:
        kubelet = node.kubelet
        node.nvml.lose(0)
        assert kubelet.wait_for(lambda: kubelet.allocatable(CORE) == 100, timeout=10.0)
        node.nvml.restore(0)
        assert kubelet.wait_for(lambda: kubelet.allocatable(CORE) == 200, timeout=10.0)


def test_nvml_wait_errors_never_stop_health_watching() -> None:
    with gpu_node(cards(1)) as node:
        kubelet = node.kubelet
        node.nvml.fail_waits(3)
        time.sleep(0.2)
        node.nvml.xid(0, 48)
        assert kubelet.wait_for(lambda: kubelet.allocatable(CORE) == 0, timeout=10.0)
        assert node.daemon is not None
        assert node.daemon.services is not None
        health = node.daemon.services.health
        assert health is not None
        assert health.running
        assert health.errors >= 1


def test_prestart_retries_while_podresources_fails_then_succeeds() -> None:
    with gpu_node(cards(1)) as node:
        p = pod("slow", (10, 5))
        # The plugin's early verification (after admission) and then PreStart find it failing.
        node.kubelet.fail_podresources(2)
        calls = node.kubelet.list_calls
        held = node.kubelet.admit(p)["c0"]
        assert node.kubelet.wait_for(lambda: node.kubelet.list_calls > calls)
        with pytest.raises(PreStartFailed) as failure:
            node.kubelet.start_container(p, "c0")
        assert failure.value.code == grpc.StatusCode.UNAVAILABLE
        node.kubelet.start_container(p, "c0")  # kubelet retries
        assert limits_of(node, held[CORE]).compute_percent == 10


def test_limits_are_ready_before_prestart_and_prestart_then_skips_podresources() -> None:
    with gpu_node(cards(1)) as node:
        p = pod("early", (20, 10))
        held = node.kubelet.admit(p)["c0"]
        path = node.config.containers_dir / container_dir_name(held[CORE]) / "limits" / "limits"
        assert node.kubelet.wait_for(path.exists)
        calls = node.kubelet.list_calls
        node.kubelet.start_container(p, "c0")
        assert node.kubelet.list_calls == calls
        assert limits_of(node, held[CORE]).compute_percent == 20


def test_a_bug_in_early_verification_leaves_the_verifier_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with gpu_node(cards(1)) as node:
        verify = node.plugin.verifier.verify_one
        failures = []

        def first_fails(allocation: object) -> bool:
            if not failures:
                failures.append(allocation)
                raise RuntimeError("injected")
            return bool(verify(allocation))

        monkeypatch.setattr(node.plugin.verifier, "verify_one", first_fails)
        node.kubelet.admit(pod("first", (20, 10)))
        held = node.kubelet.admit(pod("second", (20, 10)))["c0"]
        path = node.config.containers_dir / container_dir_name(held[CORE]) / "limits" / "limits"
        assert node.kubelet.wait_for(path.exists)
        assert len(failures) == 1


def test_container_without_memory_gets_a_clear_prestart_error() -> None:
    with gpu_node(cards(1)) as node:
        p = Pod("default", "nomem", [Container("c0", {CORE: 10})])
        node.kubelet.admit(p)
        with pytest.raises(PreStartFailed, match=f"holds no {MEMORY}"):
            node.kubelet.start_container(p, "c0")


def _stub(node: GpuNode, resource: str) -> pb_grpc.DevicePluginStub:
    name = "fracgpu-core.sock" if resource == CORE else "fracgpu-memory.sock"
    channel = grpc.insecure_channel(f"unix://{node.config.plugin_dir / name}")
    return pb_grpc.DevicePluginStub(channel)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        pytest.param(["g7-c1"], "unknown on this node", id="unknown-card"),
        pytest.param(["nvidia0"], "not a fracgpu ID", id="not-a-fracgpu-id"),
        pytest.param(["g0-m1"], "other fracgpu resource", id="memory-id-for-core"),
        pytest.param([], "no device IDs", id="empty"),
    ],
)
def test_bad_allocate_input_gets_invalid_argument_with_the_reason(
    ids: list[str], message: str
) -> None:
    with gpu_node(cards(1)) as node:
        stub = _stub(node, CORE)
        request = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]
        )
        with pytest.raises(grpc.RpcError) as failure:
            stub.Allocate(request, timeout=5)
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (failure.value.details() or "")
        with pytest.raises(grpc.RpcError) as empty:
            stub.Allocate(pb.AllocateRequest(), timeout=5)
        assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_prestart_with_unknown_or_no_ids_fails_cleanly() -> None:
    with gpu_node(cards(1)) as node:
        stub = _stub(node, MEMORY)
        with pytest.raises(grpc.RpcError) as unknown:
            stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=["g0-m3"]), timeout=5)
        assert unknown.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as empty:
            stub.PreStartContainer(pb.PreStartContainerRequest(), timeout=5)
        assert empty.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_preference_for_unknown_ids_is_empty_not_an_error() -> None:
    with gpu_node(cards(1)) as node:
        answer = _stub(node, CORE).GetPreferredAllocation(
            pb.PreferredAllocationRequest(
                container_requests=[
                    pb.ContainerPreferredAllocationRequest(
                        available_deviceIDs=["x", "g5-c1"], allocation_size=2
                    )
                ]
            ),
            timeout=5,
        )
        assert list(answer.container_responses[0].deviceIDs) == []


def test_reconciliation_frees_ended_pods_and_collects_their_directories() -> None:
    with gpu_node(cards(1)) as node:
        p = pod("short", (100, 96))
        held = run(node, p)["c0"]
        directory = node.config.containers_dir / container_dir_name(held[CORE])
        assert directory.is_dir()
        node.kubelet.remove(p)
        node.plugin.reconcile_once()
        assert node.plugin.allocator.allocations() == []
        assert not directory.exists()
        run(node, pod("next", (100, 96)))


def test_allocate_only_names_the_directories_prestart_makes_them() -> None:
    """Allocate stays off the disk while kubelet admits the pod; the directories exist (the
    shared one writable by any user, whatever the umask) before kubelet creates the container."""
    import os
    import stat

    with gpu_node(cards(1)) as node:
        node.plugin.stop_verifier()  # nothing else may make them in between
        p = pod("dirs", (20, 10))
        held = node.kubelet.admit(p)["c0"]
        directory = node.config.containers_dir / container_dir_name(held[CORE])
        assert not directory.exists()
        old = os.umask(0o077)
        try:
            node.kubelet.start_container(p, "c0")
        finally:
            os.umask(old)
        assert (directory / "limits" / "limits").is_file()
        mode = stat.S_IMODE((directory / "shared").stat().st_mode)
        assert mode == 0o777, oct(mode)
        node.kubelet.start_container(p, "c0")  # a restart finds them in place
        assert stat.S_IMODE((directory / "shared").stat().st_mode) == 0o777


def test_early_verification_lists_once_after_both_allocates() -> None:
    with gpu_node(cards(1)) as node:
        before = node.kubelet.list_calls
        held = node.kubelet.admit(pod("early", (30, 20)))["c0"]
        record = node.plugin.allocator.find(Kind.CORE, held[CORE])
        assert node.kubelet.wait_for(lambda: record.verified, timeout=2)
        # kubelet had recorded both resources by the time the verifier looked
        assert node.kubelet.list_calls - before == 1
        assert limits_of(node, held[CORE]).compute_percent == 30


def test_prestart_right_after_allocate_is_not_listed_twice() -> None:
    """When PreStartContainer beats the early verification, the verifier finds the
    allocation verified and leaves PodResources alone."""
    with gpu_node(cards(1), verify_delay_s=0.2) as node:
        before = node.kubelet.list_calls
        held = run(node, pod("fast", (30, 20)))["c0"]
        assert node.kubelet.list_calls - before == 1  # PreStart's own
        time.sleep(0.4)
        assert node.kubelet.list_calls - before == 1
        assert node.plugin.allocator.find(Kind.CORE, held[CORE]).verified


def test_a_quiet_reconciliation_writes_nothing_and_wakes_no_stream() -> None:
    with gpu_node(cards(1)) as node:
        run(node, pod("steady", (30, 20)))
        plugin = node.plugin
        plugin.reconcile_once()
        time.sleep(0.3)  # let the coalescing writer settle
        version, writes = plugin.allocator.version, plugin.checkpointer.writes
        for _ in range(3):
            plugin.reconcile_once()
        time.sleep(0.3)
        assert plugin.allocator.version == version
        assert plugin.checkpointer.writes == writes


def _listed_in_full(allocator: Allocator, kind: Kind) -> pb.ListAndWatchResponse:
    """The device list encoded entry by entry, as the plugin did before it kept pieces."""
    response = pb.ListAndWatchResponse()
    for device in allocator.devices(kind):
        response.devices.add(ID=device.id, health="Healthy" if device.healthy else "Unhealthy")
    return response


# each step changes the allocator; the sets say which ID groups' pieces (core, memory) must be
# encoded again. IDs are counts: the free IDs shown Healthy stay the same from one list to the
# next where the offer allows, so an allocation of shown IDs changes no list at all, and a
# change of the offer adds or drops IDs at the high end only.
LISTING_STEPS: list[tuple[str, Callable[[Allocator], object], set[int], set[int]]] = [
    ("card 1 fails: one card fewer offered", lambda a: a.set_health(1, False, "XID 79"), {3}, {3}),
    ("card 1 recovers", lambda a: a.set_health(1, True), {3}, {3}),
    (
        "a share takes shown IDs of groups 0 and 2: every list stays as it is",
        lambda a: (
            a.allocate(Kind.CORE, [core_id(0, n) for n in range(10)], CORE),
            a.allocate(Kind.MEMORY, [memory_id(2, 0)], MEMORY),
        ),
        set(),
        set(),
    ),
    (
        "another container's first call: its IDs were shown too",
        lambda a: a.allocate(Kind.CORE, [core_id(1, 0)], CORE),
        set(),
        set(),
    ),
]


@pytest.mark.parametrize("kind", [Kind.CORE, Kind.MEMORY], ids=["core", "memory"])
def test_listandwatch_reencodes_only_the_cards_that_changed(kind: Kind) -> None:
    allocator = Allocator([Card(i, f"GPU-{i}", "Fake", 4096, i, None) for i in range(4)])
    plugin = SimpleNamespace(allocator=allocator, resource=lambda k: f"fracgpu.io/{k.name}")
    servicer = DevicePluginServicer(plugin, kind, threading.Event())  # type: ignore[arg-type]

    def listed() -> bytes:
        sent = servicer._listing(allocator.listing(kind)[1]).SerializeToString()
        assert sent == _listed_in_full(allocator, kind).SerializeToString()
        return bytes(sent)

    listed()
    for name, step, changed_core, changed_memory in LISTING_STEPS:
        before = [piece for _, piece in servicer._pieces]
        step(allocator)
        listed()
        after = [piece for _, piece in servicer._pieces]
        reused = {i for i, (old, new) in enumerate(zip(before, after, strict=True)) if old is new}
        expected = changed_core if kind is Kind.CORE else changed_memory
        assert reused == set(range(4)) - expected, name


def test_whole_cards_without_memory_take_entirely_free_cards_and_all_their_memory() -> None:
    with gpu_node(cards(4, 24 * GIB)) as node:
        kubelet = node.kubelet
        run(node, pod("share", (30, 10)))  # card 0 is partly used
        whole = Pod("default", "whole", [Container("c0", {CORE: 200})])
        calls = len(kubelet.calls)
        held = run(node, whole)["c0"]
        assert set(held) == {CORE}
        assert card_of(node, held[CORE]) == {1, 2}
        # one resource, one Allocate: no wait for a memory call that never comes
        assert [rpc for _, rpc in kubelet.calls[calls:]].count("Allocate") == 1
        limits = limits_of(node, held[CORE])
        assert limits.memory_bytes == 24 * GIB * 2**20
        assert limits.compute_percent == 100
        assert len(limits.devices) == 2
        edits = cdi_edits(node, held[CORE])
        assert edits["env"] == [f"FRACGPU_MEMORY_MIB={24 * GIB}"]
        assert len(edits["mounts"]) == len(edits["deviceNodes"]) == 2
        # the cards' memory is no one else's: offered is card 0's rest and card 3
        assert kubelet.wait_for(lambda: len(kubelet.free(MEMORY)) == (96 - 10) + 96)


def test_an_init_containers_limits_log_names_the_pod_not_the_app_container(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with gpu_node(cards(1), verify_retries=0) as node:
        p = Pod(
            "default",
            "init",
            [Container("app", {CORE: 30, MEMORY: 10})],
            init_containers=[Container("fetch", {CORE: 30, MEMORY: 10})],
        )
        held = node.kubelet.admit(p)
        # the app container reuses the init container's IDs
        assert {r: set(i) for r, i in held["fetch"].items()} == {
            r: set(i) for r, i in held["app"].items()
        }
        caplog.clear()
        caplog.set_level(logging.INFO, logger="deviceplugin")
        node.kubelet.start_container(p, "fetch")
        (record,) = [r for r in caplog.records if r.getMessage() == "limits written"]
        assert record.pod == "default/init"  # type: ignore[attr-defined]
        assert record.listed_container == "app"  # type: ignore[attr-defined]
        assert not hasattr(record, "container")


@pytest.mark.parametrize(
    ("fault", "config"),
    [
        pytest.param(1, {}, id="one empty listing, confirmed wrong by the next"),
        pytest.param(
            3, {"kubelet_settle_s": 3600.0}, id="empty listings of a kubelet just started"
        ),
    ],
)
def test_an_empty_listing_frees_nothing_until_confirmed(
    fault: int, config: dict[str, float]
) -> None:
    """kubelet answers List with no pods right after it restarts: the containers it still runs
    keep their devices and their limits."""
    with gpu_node(cards(1), reconcile_confirm_s=0.05, **config) as node:
        p = pod("running", (30, 10))
        held = run(node, p)["c0"]
        path = node.config.containers_dir / container_dir_name(held[CORE]) / "limits" / "limits"
        node.kubelet.empty_listings(fault)
        for _ in range(fault):
            node.plugin.reconcile_once()
            time.sleep(0.06)
        node.plugin.reconcile_once()  # kubelet lists its pods again (or is still settling)
        assert len(node.plugin.allocator.allocations()) == 1
        assert path.is_file()


def test_a_container_adopted_after_its_files_went_gets_its_limits_back() -> None:
    with gpu_node(cards(1)) as node:
        held = run(node, pod("running", (30, 10)))["c0"]
        path = node.config.containers_dir / container_dir_name(held[CORE]) / "limits" / "limits"
        node.stop_plugin()
        node.config.checkpoint_path.unlink()
        shutil.rmtree(node.config.containers_dir)  # as an older plugin's collection left it
        node.start_plugin()
        assert node.wait_registered()
        assert path.is_file()
        assert limits_of(node, held[CORE]).compute_percent == 30


def test_capacity_of_an_ended_pod_returns_within_two_seconds() -> None:
    """With the plugin's own reconciliation settings; the grace for young allocations (an
    Allocate racing a List) is left out, so that the test need not wait for it."""
    defaults = Config()
    with gpu_node(
        cards(1),
        reconcile_interval_s=defaults.reconcile_interval_s,
        reconcile_confirm_s=defaults.reconcile_confirm_s,
    ) as node:
        kubelet = node.kubelet
        p = pod("short", (100, 96))
        run(node, p)
        time.sleep(0.2)
        assert kubelet.allocatable(MEMORY) == 96
        assert kubelet.free(CORE) == set()
        kubelet.remove(p)
        ended = time.monotonic()
        assert kubelet.wait_for(lambda: len(kubelet.free(CORE)) == 100, timeout=5.0)
        assert time.monotonic() - ended < 2.0


def test_idle_listandwatch_streams_cannot_starve_allocate() -> None:
    with gpu_node(cards(1)) as node:
        channel = grpc.insecure_channel(f"unix://{node.config.plugin_dir / 'fracgpu-core.sock'}")
        stub = pb_grpc.DevicePluginStub(channel)
        streams = [stub.ListAndWatch(pb.Empty()) for _ in range(12)]
        try:
            refused = 0
            for stream in streams:
                try:
                    next(stream)
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    refused += 1
            assert refused >= 12 - MAX_STREAMS
            started = time.monotonic()
            run(node, pod("still", (30, 10)))
            assert time.monotonic() - started < 2.0
        finally:
            channel.close()


def test_a_stop_returns_after_every_listandwatch_stream_has_ended(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """gRPC's stop returns while a stream's worker may still wait in the allocator; the plugin's
    stop waits for it, so no thread of the plugin outlives the stop (CI once saw one log into a
    closed stream after its test had ended)."""
    caplog.set_level(logging.INFO, logger="deviceplugin.classic.service")

    def said(message: str) -> int:
        return sum(r.getMessage() == message for r in caplog.records)

    with gpu_node(cards(1)) as node:
        assert node.kubelet.wait_for(lambda: said("ListAndWatch opened") == 2, timeout=5.0)
        node.stop_plugin()
        assert said("ListAndWatch closed") == 2


def test_pods_that_the_scheduler_places_are_admitted_through_churn() -> None:
    """Single-container pods with proportional shares and whole cards (with memory and
    without), created and deleted at random on a four-card node: every pod that kube-scheduler's
    check lets onto the node (once kubelet has the plugin's latest lists) is admitted."""
    rng = random.Random(7)
    with gpu_node(cards(4, 24 * GIB)) as node:
        kubelet = node.kubelet
        live: list[Pod] = []
        placed = failed = 0
        for i in range(40):
            if live and rng.random() < 0.3:
                kubelet.remove(live.pop(rng.randrange(len(live))))
                node.plugin.reconcile_once()
            roll = rng.random()
            if roll < 0.05:
                requests = {CORE: 100}
            elif roll < 0.1:
                requests = {CORE: 100, MEMORY: 96}
            else:
                core = rng.randint(5, 90)
                requests = {CORE: core, MEMORY: max(1, core * 96 // 100)}
            p = Pod("default", f"p{i}", [Container("c0", requests)])
            time.sleep(0.05)  # the scheduler's view: lists as the plugin last sent them
            if not kubelet.schedulable(p):
                continue
            placed += 1
            try:
                kubelet.admit(p)
            except AdmissionError:
                failed += 1
                continue
            live.append(p)
        assert placed >= 10
        assert failed == 0
        assert not kubelet.violations


@pytest.mark.parametrize(
    ("delay_s", "spacing_s"),
    [
        pytest.param(30.0, 0.05, id="waiting-for-its-first-look"),
        pytest.param(0.0, 30.0, id="waiting-between-looks"),
    ],
)
def test_a_verifier_stop_returns_at_once_and_the_verifier_has_ended(
    delay_s: float, spacing_s: float
) -> None:
    """The early verifier waits before each look at PodResources; a stop (the plugin's, or a
    test's end) ends it wherever it waits, so it never logs after its owner has gone."""
    from deviceplugin.classic.verifier import EarlyVerifier

    looks: list[float] = []

    def not_yet(allocation: object) -> bool:
        looks.append(time.monotonic())
        return False  # not listed yet: look again after spacing_s

    verifier = EarlyVerifier(
        not_yet, delay_s=delay_s, retries=5, spacing_s=spacing_s, stop_within_s=6.0
    )
    verifier.start()
    thread = verifier._thread
    assert thread is not None
    verifier.submit(SimpleNamespace(verified=False))  # type: ignore[arg-type]
    deadline = time.monotonic() + 2
    while delay_s == 0 and not looks and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    verifier.stop()
    assert time.monotonic() - started < 1.0
    assert not thread.is_alive()
    assert len(looks) == (0 if delay_s else 1)
