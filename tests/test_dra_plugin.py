"""``fracgpu dra-plugin`` end to end on a fake node: fake NVML, the fake API server with the
scheduler-like allocator, the strict fake kubelet DRA side over real gRPC, and a CDI runtime
that resolves what kubelet would hand to containerd."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from core import contract
from core.contract import Limits
from deviceplugin._proto import dra_v1_pb2 as dra
from deviceplugin._proto import dra_v1_pb2_grpc as dra_grpc
from deviceplugin._proto import drahealth_v1alpha1_pb2 as health
from testkit import cdiruntime
from testkit.drakubelet import ClaimKey
from testkit.dranode import DRIVER, DraNode, dra_node, share_claim

GIB = 2**30
MIB = 2**20
CARD_MIB = 81559  # what NVML reports for an H100 80GB; the slice offers 81408 MiB


def _uuid(index: int) -> str:
    return f"GPU-{index:08x}-fake-4000-8000-{index:012x}"


async def prepared(node: DraNode, name: str, **share: Any) -> tuple[dict[str, Any], list[str]]:
    """Create, allocate and prepare a claim; the claim and its CDI IDs."""
    node.create_claim(share_claim(name, **share))
    claim = node.allocate(name)
    assert node.kubelet is not None
    devices = await node.kubelet.prepare(DRIVER, [node.key(claim)])
    return claim, [i for d in devices[claim["metadata"]["uid"]] for i in d.cdi_device_ids]


def limits_of(node: DraNode, claim: dict[str, Any]) -> Limits:
    path = node.config.claims_dir / claim["metadata"]["uid"] / "limits" / contract.LIMITS_FILE
    return Limits.parse(path.read_text())


def edits(node: DraNode, ids: list[str]) -> cdiruntime.Edits:
    return cdiruntime.resolve([node.config.cdi_root], ids)


# ---- registration ------------------------------------------------------------------------------


async def test_registers_with_v1_first() -> None:
    async with dra_node() as node:
        assert node.kubelet is not None
        assert node.kubelet.plugins[DRIVER].service == "v1.DRAPlugin"


async def test_get_info_answers_within_a_second() -> None:
    async with dra_node() as node:
        assert node.kubelet is not None
        assert max(node.kubelet.getinfo_seconds) < 1.0


async def test_the_endpoint_is_the_service_socket() -> None:
    async with dra_node() as node:
        assert node.kubelet is not None
        assert node.kubelet.plugins[DRIVER].endpoint == str(node.config.service_socket)


async def test_the_health_stream_lists_every_card_healthy() -> None:
    async with dra_node(3) as node:
        assert node.kubelet is not None
        plugin = node.kubelet.plugins[DRIVER]
        assert await node.kubelet.wait_for(lambda: bool(plugin.health))
        states = {(d.device.device_name, d.health) for d in plugin.health[-1].devices}
        assert states == {(f"gpu-{i}", health.HEALTHY) for i in range(3)}


async def test_kubelet_saw_no_protocol_violation() -> None:
    async with dra_node() as node:
        await prepared(node, "a", cores=30, memory="8Gi")
        assert node.kubelet is not None
        assert node.kubelet.violations == []


async def test_registers_while_the_api_server_is_down() -> None:
    async with dra_node(start=False) as node:
        node.fake.down("503")
        await node.start_plugin()
        assert await node.wait_registered(2.0)


async def test_the_health_list_is_repeated_without_changes() -> None:
    async with dra_node() as node:
        assert node.kubelet is not None
        plugin = node.kubelet.plugins[DRIVER]
        assert await node.kubelet.wait_for(lambda: bool(plugin.health))
        seen = len(plugin.health)
        resend = node.config.health_resend_s
        assert await node.kubelet.wait_for(lambda: len(plugin.health) > seen, 3 * resend)


# ---- the slice ---------------------------------------------------------------------------------


async def test_publishes_one_device_per_card() -> None:
    async with dra_node(4) as node:
        published = await node.wait_slice()
        assert [d["name"] for d in published["spec"]["devices"]] == [f"gpu-{i}" for i in range(4)]


async def test_an_nvml_event_taints_the_card_within_a_second() -> None:
    async with dra_node(2) as node:
        await node.wait_slice()
        started = time.monotonic()
        node.nvml.xid(1, 79)
        await node.wait_slice(lambda s: "taints" in s["spec"]["devices"][1], within_s=1.0)
        assert time.monotonic() - started < 1.0


async def test_an_nvml_event_reaches_the_health_stream() -> None:
    async with dra_node(2) as node:
        assert node.kubelet is not None
        plugin = node.kubelet.plugins[DRIVER]
        node.nvml.xid(1, 79)

        def unhealthy() -> bool:
            return bool(plugin.health) and plugin.health[-1].devices[1].health == health.UNHEALTHY

        assert await node.kubelet.wait_for(unhealthy, within_s=1.0)


async def test_a_tainted_card_gets_no_new_share() -> None:
    async with dra_node(2) as node:
        node.nvml.xid(0, 79)
        await node.wait_slice(lambda s: "taints" in s["spec"]["devices"][0])
        node.create_claim(share_claim("a", cores=30, memory="8Gi"))
        claim = node.allocate("a")
        assert claim["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-1"


async def test_kubelet_restart_republishes_within_two_seconds() -> None:
    async with dra_node() as node:
        assert node.kubelet is not None
        await node.wait_slice()
        started = time.monotonic()
        await node.kubelet.restart()
        await node.wait_slice(within_s=2.0)
        assert time.monotonic() - started < 2.0


async def test_kubelet_restart_registers_the_plugin_again() -> None:
    async with dra_node() as node:
        assert node.kubelet is not None
        await node.kubelet.restart()
        assert await node.wait_registered(2.0)


async def test_a_slice_wiped_while_the_plugin_was_away_comes_back() -> None:
    async with dra_node(wiping_delay_s=0.2) as node:
        assert node.kubelet is not None
        await node.wait_slice()
        await node.stop_plugin()
        assert await node.kubelet.wait_for(lambda: node.slices() == [], within_s=3.0)
        await node.start_plugin()
        await node.wait_slice(within_s=2.0)


async def test_a_deleted_registration_socket_is_served_again() -> None:
    async with dra_node() as node:
        assert node.kubelet is not None
        kubelet = node.kubelet
        before = kubelet.registrations
        node.config.registry_socket.unlink()
        assert await kubelet.wait_for(lambda: kubelet.registrations > before, within_s=2.0)


# ---- prepare -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("share", "expected"),
    [
        pytest.param({"cores": 30, "memory": "8Gi"}, Limits((_uuid(0),), 8 * GIB, 30), id="share"),
        pytest.param(
            {"cores": 1, "memory": "300Mi"}, Limits((_uuid(0),), 512 * MIB, 1), id="rounded-up"
        ),
        pytest.param({}, Limits((_uuid(0),), 81408 * MIB, 100), id="whole-card"),
        pytest.param(
            {"count": 2, "cores": 50, "memory": "20Gi"},
            Limits((_uuid(0), _uuid(1)), 20 * GIB, 50),
            id="two-cards-half-each",
        ),
    ],
)
async def test_limits_are_what_the_claim_consumed(share: dict[str, Any], expected: Limits) -> None:
    async with dra_node(2, CARD_MIB) as node:
        claim, _ = await prepared(node, "c", **share)
        assert limits_of(node, claim) == expected


@pytest.mark.parametrize(
    ("share", "env"),
    [
        pytest.param(
            {"cores": 30, "memory": "8Gi"},
            {
                "NVIDIA_VISIBLE_DEVICES": contract.DEVICE_LIST_MOUNT_ROOT,
                "FRACGPU_GPU": "0.3",
                "FRACGPU_GPU_COUNT": "1",
                "FRACGPU_MEMORY_MIB": "8192",
            },
            id="share",
        ),
        pytest.param(
            {"cores": 30, "memory": "8Gi", "count": 2},
            {
                "NVIDIA_VISIBLE_DEVICES": contract.DEVICE_LIST_MOUNT_ROOT,
                "FRACGPU_GPU": "0.3",
                "FRACGPU_GPU_COUNT": "2",
                "FRACGPU_MEMORY_MIB": "8192",
            },
            id="share-of-two-cards",
        ),
        pytest.param(
            {"count": 2},
            {
                "NVIDIA_VISIBLE_DEVICES": contract.DEVICE_LIST_MOUNT_ROOT,
                "FRACGPU_GPU": "2",
                "FRACGPU_GPU_COUNT": "2",
                "FRACGPU_MEMORY_MIB": "81408",
            },
            id="two-whole-cards",
        ),
    ],
)
async def test_cdi_sets_the_environment(share: dict[str, Any], env: dict[str, str]) -> None:
    async with dra_node(2, CARD_MIB) as node:
        _, ids = await prepared(node, "c", **share)
        assert edits(node, ids).env_map() == env


@pytest.mark.parametrize(
    ("container_path", "mode"),
    [
        pytest.param(contract.CONTAINER_HOOK_LIBRARY, "ro", id="hook"),
        pytest.param(contract.LD_SO_PRELOAD, "ro", id="preload"),
        pytest.param(contract.CONTAINER_LIMITS_DIR, "ro", id="limits"),
        pytest.param(contract.CONTAINER_SHARED_DIR, "rw", id="accounting"),
    ],
)
async def test_cdi_mounts(container_path: str, mode: str) -> None:
    async with dra_node() as node:
        _, ids = await prepared(node, "c", cores=30, memory="8Gi")
        mount = edits(node, ids).mount(container_path)
        assert mode in mount["options"]


@pytest.mark.parametrize(
    ("share", "cards"),
    [
        pytest.param({"cores": 30, "memory": "8Gi"}, [0], id="a share: its card"),
        pytest.param({"count": 2}, [0, 1], id="two whole cards: both"),
    ],
)
async def test_cards_are_named_by_device_list_mounts(
    share: dict[str, Any], cards: list[int]
) -> None:
    async with dra_node(2, CARD_MIB) as node:
        _, ids = await prepared(node, "c", **share)
        for card in cards:
            mount = edits(node, ids).mount(f"{contract.DEVICE_LIST_MOUNT_ROOT}/{_uuid(card)}")
            assert mount["hostPath"] == contract.DEVICE_LIST_HOST_PATH
            assert "ro" in mount["options"]


async def test_the_limits_mount_holds_the_claims_limits_file() -> None:
    async with dra_node() as node:
        claim, ids = await prepared(node, "c", cores=30, memory="8Gi")
        host = edits(node, ids).mount(contract.CONTAINER_LIMITS_DIR)["hostPath"]
        mounted = Path(host) / contract.LIMITS_FILE
        assert Limits.parse(mounted.read_text()) == limits_of(node, claim)


async def test_the_card_device_node_is_given() -> None:
    async with dra_node(2) as node:
        _, ids = await prepared(node, "c", count=2)
        paths = {n["path"] for n in edits(node, ids).device_nodes}
        assert {"/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl"} <= paths


async def test_each_device_gets_its_own_cdi_id() -> None:
    async with dra_node(2) as node:
        _, ids = await prepared(node, "c", count=2)
        assert len(set(ids)) == 2


async def test_shares_of_one_card_get_distinct_cdi_ids() -> None:
    async with dra_node() as node:
        _, first = await prepared(node, "a", cores=30, memory="8Gi")
        _, second = await prepared(node, "b", cores=30, memory="8Gi")
        assert set(first).isdisjoint(second)


async def test_the_answer_echoes_share_id_and_request() -> None:
    async with dra_node() as node:
        node.create_claim(share_claim("a", cores=30, memory="8Gi"))
        claim = node.allocate("a")
        assert node.kubelet is not None
        (device,) = (await node.kubelet.prepare(DRIVER, [node.key(claim)]))[
            claim["metadata"]["uid"]
        ]
        result = claim["status"]["allocation"]["devices"]["results"][0]
        assert (list(device.request_names), device.share_id, device.pool_name) == (
            ["gpu"],
            result["shareID"],
            "node-a",
        )


async def test_eight_claims_in_one_call() -> None:
    async with dra_node(2) as node:
        keys = []
        for i in range(8):
            node.create_claim(share_claim(f"c{i}", cores=20, memory="4Gi"))
            keys.append(node.key(node.allocate(f"c{i}")))
        assert node.kubelet is not None
        answered = await node.kubelet.prepare(DRIVER, keys)
        assert sorted(answered) == sorted(k.uid for k in keys)


async def _raw_prepare(
    node: DraNode, key: ClaimKey, *, times: int = 1
) -> dra.NodePrepareResourceResponse:
    """Call the plugin directly, past kubelet's own checks (``times``: the claim named again)."""
    claim = dra.Claim(namespace=key.namespace, name=key.name, uid=key.uid)
    async with grpc.aio.insecure_channel(f"unix://{node.config.service_socket}") as channel:
        response = await dra_grpc.DRAPluginStub(channel).NodePrepareResources(
            dra.NodePrepareResourcesRequest(claims=[claim] * times), timeout=10
        )
    answer: dra.NodePrepareResourceResponse = response.claims[key.uid]
    return answer


@pytest.mark.parametrize(
    ("setup", "words"),
    [
        pytest.param("deleted", "not found on the API server", id="claim-deleted"),
        pytest.param("replaced", "was replaced", id="claim-replaced"),
        pytest.param("unallocated", "not allocated yet", id="claim-unallocated"),
    ],
)
async def test_claims_that_cannot_be_prepared_fail_with_a_reason(setup: str, words: str) -> None:
    async with dra_node() as node:
        node.create_claim(share_claim("a", cores=30, memory="8Gi"))
        if setup != "unallocated":
            node.allocate("a")
        key = node.key(node.fake.get("resourceclaims", "a", "default") or {})
        if setup == "deleted":
            node.fake.remove("resourceclaims", "a", "default")
        if setup == "replaced":
            key = ClaimKey(key.namespace, key.name, "0e1b8c4e-0000-4000-8000-000000000000")
        answer = await _raw_prepare(node, key)
        assert words in answer.error


async def test_a_failed_claim_writes_no_cdi_spec() -> None:
    async with dra_node() as node:
        node.create_claim(share_claim("a", cores=30, memory="8Gi"))
        await _raw_prepare(node, node.key(node.fake.get("resourceclaims", "a", "default") or {}))
        assert list(node.config.cdi_root.iterdir()) == []


@pytest.mark.parametrize("mode", [pytest.param("503", id="503"), pytest.param("drop", id="drop")])
async def test_the_api_server_down_fails_the_claim_for_a_retry(mode: str) -> None:
    async with dra_node() as node:
        node.create_claim(share_claim("a", cores=30, memory="8Gi"))
        key = node.key(node.allocate("a"))
        node.fake.down(mode)
        try:
            answer = await _raw_prepare(node, key)
        finally:
            node.fake.up()
        assert "kubelet retries" in answer.error


async def test_a_retried_prepare_answers_the_same_ids() -> None:
    async with dra_node() as node:
        claim, ids = await prepared(node, "a", cores=30, memory="8Gi")
        again = await _raw_prepare(node, node.key(claim))
        assert list(again.devices[0].cdi_device_ids) == ids


async def test_a_claim_named_twice_is_prepared_once() -> None:
    async with dra_node() as node:
        node.create_claim(share_claim("a", cores=30, memory="8Gi"))
        answer = await _raw_prepare(node, node.key(node.allocate("a")), times=2)
        assert len(answer.devices) == 1


async def test_concurrent_prepares_are_all_checkpointed() -> None:
    async with dra_node(2) as node:
        keys = []
        for i in range(6):
            node.create_claim(share_claim(f"c{i}", cores=10, memory="2Gi"))
            keys.append(node.key(node.allocate(f"c{i}")))
        assert node.kubelet is not None
        await asyncio.gather(*(node.kubelet.prepare(DRIVER, [k]) for k in keys))
        document = json.loads(node.config.checkpoint_path.read_text())
        assert sorted(document["claims"]) == sorted(k.uid for k in keys)


# ---- unprepare ---------------------------------------------------------------------------------


async def test_unprepare_removes_the_claims_files() -> None:
    async with dra_node() as node:
        claim, _ = await prepared(node, "a", cores=30, memory="8Gi")
        assert node.kubelet is not None
        await node.kubelet.unprepare(DRIVER, [node.key(claim)])
        uid = claim["metadata"]["uid"]
        left = [p.name for p in node.config.cdi_root.iterdir()] + [
            p.name for p in node.config.claims_dir.iterdir()
        ]
        assert [name for name in left if uid in name] == []


@pytest.mark.parametrize("times", [pytest.param(2, id="twice"), pytest.param(1, id="once")])
async def test_unprepare_is_idempotent(times: int) -> None:
    async with dra_node() as node:
        claim, _ = await prepared(node, "a", cores=30, memory="8Gi")
        assert node.kubelet is not None
        for _ in range(times):
            await node.kubelet.unprepare(DRIVER, [node.key(claim)])
        assert node.plugin.driver is not None
        assert node.plugin.driver.prepared == {}


async def test_unprepare_of_an_unknown_claim_succeeds() -> None:
    async with dra_node() as node:
        assert node.kubelet is not None
        unknown = ClaimKey("default", "never", "3f2a0000-0000-4000-8000-000000000000")
        await node.kubelet.unprepare(DRIVER, [unknown])
        assert node.kubelet.violations == []


# ---- restarts, deletions while down, reboots ---------------------------------------------------


async def test_plugin_restart_keeps_prepared_claims() -> None:
    async with dra_node() as node:
        claim, _ = await prepared(node, "a", cores=30, memory="8Gi")
        await node.stop_plugin()
        await node.start_plugin()
        assert await node.wait_registered(2.0)
        assert node.plugin.driver is not None
        assert list(node.plugin.driver.prepared) == [claim["metadata"]["uid"]]


async def test_after_a_plugin_restart_the_cdi_ids_still_resolve() -> None:
    async with dra_node() as node:
        _, ids = await prepared(node, "a", cores=30, memory="8Gi")
        await node.stop_plugin()
        await node.start_plugin()
        assert edits(node, ids).env_map()["FRACGPU_GPU"] == "0.3"


async def test_after_a_plugin_restart_unprepare_removes_the_files() -> None:
    async with dra_node() as node:
        claim, _ = await prepared(node, "a", cores=30, memory="8Gi")
        await node.stop_plugin()
        await node.start_plugin()
        assert await node.wait_registered(2.0)
        assert node.kubelet is not None
        await node.kubelet.unprepare(DRIVER, [node.key(claim)])
        assert list(node.config.cdi_root.iterdir()) == []


async def test_a_claim_deleted_while_the_plugin_was_down_is_dropped() -> None:
    async with dra_node() as node:
        claim, _ = await prepared(node, "a", cores=30, memory="8Gi")
        await node.stop_plugin()
        node.fake.remove("resourceclaims", "a", "default")
        await node.start_plugin()
        assert node.plugin.driver is not None
        driver = node.plugin.driver
        assert node.kubelet is not None
        assert await node.kubelet.wait_for(lambda: driver.prepared == {}, within_s=3.0)
        assert not (node.config.claims_dir / claim["metadata"]["uid"]).exists()


async def test_a_reboot_that_wiped_the_cdi_directory_is_repaired() -> None:
    async with dra_node() as node:
        _, ids = await prepared(node, "a", cores=30, memory="8Gi")
        await node.stop_plugin()
        shutil.rmtree(node.config.cdi_root)
        await node.start_plugin()
        assert edits(node, ids).env_map()["FRACGPU_MEMORY_MIB"] == "8192"


async def test_prepare_rewrites_a_cdi_spec_that_vanished() -> None:
    async with dra_node() as node:
        claim, ids = await prepared(node, "a", cores=30, memory="8Gi")
        for path in node.config.cdi_root.iterdir():
            path.unlink()
        await _raw_prepare(node, node.key(claim))
        assert edits(node, ids).env_map()["FRACGPU_GPU"] == "0.3"


async def test_files_no_claim_names_are_removed_at_start() -> None:
    async with dra_node(start=False) as node:
        node.config.cdi_root.mkdir(parents=True)
        stray = node.config.cdi_root / "k8s.gpu.fracgpu.io-claim_0badc0de.json"
        stray.write_text("{}")
        other_vendor = node.config.cdi_root / "nvidia.yaml"
        other_vendor.write_text("cdiVersion: 0.5.0\n")
        await node.start_plugin()
        assert sorted(p.name for p in node.config.cdi_root.iterdir()) == ["nvidia.yaml"]


async def test_a_corrupt_checkpoint_is_ignored() -> None:
    async with dra_node(start=False) as node:
        node.config.checkpoint_path.parent.mkdir(parents=True)
        node.config.checkpoint_path.write_text("{not json")
        await node.start_plugin()
        assert await node.wait_registered(2.0)


# ---- the share in its claim ---------------------------------------------------------------------


def _entries(node: DraNode, claim: dict[str, Any]) -> list[dict[str, Any]]:
    now = node.fake.get("resourceclaims", claim["metadata"]["name"], "default") or {}
    return [d for d in (now.get("status") or {}).get("devices") or [] if d["driver"] == DRIVER]


async def _eventually(check: Any, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def test_the_share_shows_in_its_claim_follows_card_health_and_goes_at_unprepare() -> None:
    async with dra_node(2) as node:
        claim, _ = await prepared(node, "shown", cores=30, memory="8Gi")
        assert await _eventually(lambda: bool(_entries(node, claim)))
        (entry,) = _entries(node, claim)
        assert (entry["data"]["cores"], entry["data"]["memoryMiB"]) == (30, 8192)
        card = entry["data"]["card"]

        def healthy() -> str:
            (e,) = _entries(node, claim)
            return {c["type"]: c["status"] for c in e["conditions"]}["CardHealthy"]

        node.nvml.xid(card, 79)
        assert await _eventually(lambda: healthy() == "False")
        assert node.kubelet is not None
        await node.kubelet.unprepare(DRIVER, [node.key(claim)])
        assert await _eventually(lambda: not _entries(node, claim))
