"""``fracgpu why``: each state a GPU pod can be in, named in the user's units, from objects as
the API server returns them; and the command against the strict fake API server."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from core import dra
from core.labels import FREE_ANNOTATION, FREE_VERSION
from fracgpu.why import Cluster, diagnose, gather, render, run
from testkit.apiserver import FakeApiServer

NS = "team-a"


def pod(
    name: str = "train",
    *,
    limits: dict[str, str] | None = None,
    phase: str = "Pending",
    node: str = "",
    scheduled: tuple[str, str] | None = None,
    claims: list[str] | None = None,
    waiting: str = "",
) -> dict[str, Any]:
    """A pod as the API server returns it after the webhook (canonical limits)."""
    status: dict[str, Any] = {"phase": phase}
    if scheduled is not None:
        status["conditions"] = [
            {"type": "PodScheduled", "status": scheduled[0], "message": scheduled[1]}
        ]
    if claims:
        status["resourceClaimStatuses"] = [
            {"name": f"gpu-{i}", "resourceClaimName": c} for i, c in enumerate(claims)
        ]
    if waiting:
        status["containerStatuses"] = [
            {"name": "main", "state": {"waiting": {"reason": waiting, "message": "no card yet"}}}
        ]
    spec: dict[str, Any] = {
        "containers": [{"name": "main", "resources": {"limits": limits or {}}}],
    }
    if node:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}"},
        "spec": spec,
        "status": status,
    }


SHARE = {"fracgpu.io/core": "50", "fracgpu.io/memory": "32"}  # 0.50 card, 8192 MiB


def node(name: str, *cards: tuple[int, int]) -> dict[str, Any]:
    document = {
        "version": FREE_VERSION,
        "cards": [{"index": i, "cores": c, "memoryMiB": m} for i, (c, m) in enumerate(cards)],
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "annotations": {FREE_ANNOTATION: json.dumps(document)}},
    }


def claim(name: str, cores: str = "50", memory: str = "8Gi") -> dict[str, Any]:
    exactly = {
        "deviceClassName": dra.DEVICE_CLASS,
        "capacity": {"requests": {dra.CORES: cores, dra.MEMORY: memory}},
    }
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }


def card_slice(node_name: str, cards: int) -> dict[str, Any]:
    devices = [
        {
            "name": f"gpu-{i}",
            "capacity": {dra.CORES: {"value": "100"}, dra.MEMORY: {"value": "80Gi"}},
        }
        for i in range(cards)
    ]
    spec = {"driver": dra.DRIVER, "nodeName": node_name, "pool": {"name": node_name}}
    return {"spec": {**spec, "devices": devices}}


def allocated(name: str, device: str, cores: str, memory: str) -> dict[str, Any]:
    result = {
        "driver": dra.DRIVER,
        "pool": "node-a",
        "device": device,
        "consumedCapacity": {dra.CORES: cores, dra.MEMORY: memory},
    }
    return {**claim(name), "status": {"allocation": {"devices": {"results": [result]}}}}


INSUFFICIENT = ("False", "0/1 nodes are available: 1 Insufficient fracgpu.io/core.")
NO_CLAIM_FIT = ("False", "0/1 nodes are available: 1 cannot allocate all claims.")


@pytest.mark.parametrize(
    ("the_pod", "cluster", "state", "says"),
    [
        pytest.param(pod(), Cluster(), "no-gpu", "asks no fracgpu GPU", id="no-gpu"),
        pytest.param(
            pod(limits=SHARE, phase="Running", node="node-a"), Cluster(), "running",
            "runs on node node-a", id="running",
        ),
        pytest.param(
            pod(limits=SHARE, scheduled=INSUFFICIENT),
            Cluster(nodes=[node("node-a", (40, 40960), (30, 70000))]),
            "waiting-for-a-card",
            "no card can host it now: largest free share on any node: 0.40 card and 40960 MiB "
            "on card 0 of node-a; this pod asks 0.50 card and 8192 MiB",
            id="device-plugin-no-card",
        ),
        pytest.param(
            pod(limits=SHARE, scheduled=INSUFFICIENT),
            Cluster(nodes=None, events=[{"type": "Normal", "reason": "GPUShareDoesNotFit",
                                         "message": "largest free share on any node: x"}]),
            "waiting-for-a-card", "largest free share on any node: x (the webhook's last event)",
            id="device-plugin-nodes-forbidden-event-shown",
        ),
        pytest.param(
            pod(limits=SHARE, scheduled=INSUFFICIENT), Cluster(), "waiting-for-a-card",
            "listing Nodes is forbidden", id="device-plugin-nothing-readable",
        ),
        pytest.param(
            pod(claims=["train-gpu"], scheduled=NO_CLAIM_FIT),
            Cluster(
                claims=[claim("train-gpu")],
                slices=[card_slice("node-a", 2)],
                every_claim=[
                    allocated("a", "gpu-0", "60", "4Gi"), allocated("b", "gpu-1", "70", "4Gi")
                ],
            ),
            "waiting-for-a-card",
            "largest free share on any node: 0.40 card and 77824 MiB on gpu-0 of node-a; this "
            "pod asks 0.50 card and 8192 MiB",
            id="dra-no-card",
        ),
        pytest.param(
            pod(limits=SHARE, scheduled=("False", "0/1 nodes are available: 1 node(s) had "
                                                  "untolerated taint {x: y}.")),
            Cluster(), "unschedulable", "the scheduler says: 0/1 nodes are available: 1 node(s)",
            id="other-scheduling-reason",
        ),
        pytest.param(
            pod(limits=SHARE), Cluster(), "scheduling", "no scheduler has placed it yet",
            id="not-scheduled-yet",
        ),
        pytest.param(
            pod(limits=SHARE, node="node-a", waiting="ContainerCreating"), Cluster(), "starting",
            "placed on node node-a; container main: ContainerCreating: no card yet",
            id="starting",
        ),
        pytest.param(
            pod(limits=SHARE, phase="Failed", node="node-a"), Cluster(), "ended", "it ended",
            id="ended",
        ),
    ],
)  # fmt: skip
def test_each_state_in_the_users_units(
    the_pod: dict[str, Any], cluster: Cluster, state: str, says: str
) -> None:
    diagnosis = diagnose(the_pod, cluster)
    assert diagnosis.state == state
    assert says in diagnosis.message
    assert says in render(diagnosis) or state == "no-gpu"


def test_a_dra_pod_whose_claims_are_not_made_yet_is_not_called_gpu_free() -> None:
    waiting = pod()
    waiting["spec"]["resourceClaims"] = [
        {"name": "gpu-0", "resourceClaimTemplateName": "fracgpu-0-50-8192"}
    ]
    diagnosis = diagnose(waiting, Cluster(claims=[]))
    assert (diagnosis.mode, diagnosis.state) == ("dra", "scheduling")


def test_warnings_are_listed_newest_last() -> None:
    events = [
        {"type": "Warning", "reason": f"R{i}", "message": f"m{i}", "count": i} for i in range(7)
    ]
    diagnosis = diagnose(pod(limits=SHARE), Cluster(events=events))
    assert diagnosis.events[0] == "Warning R2 (x2): m2"
    assert diagnosis.events[-1] == "Warning R6 (x6): m6"
    assert len(diagnosis.events) == 5


async def test_gather_reads_what_the_diagnosis_needs() -> None:
    async with FakeApiServer() as fake, fake.api_client() as api:
        fake.put(node("node-a", (40, 40960)))
        fake.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        fake.put(pod(limits=SHARE, scheduled=INSUFFICIENT))
        the_pod, cluster = await gather(api, NS, "train")
        assert cluster.nodes is not None
        assert diagnose(the_pod, cluster).state == "waiting-for-a-card"


@pytest.mark.parametrize(
    ("name", "code", "output"),
    [
        pytest.param("missing", 1, "", id="no-such-pod"),
        pytest.param("train", 0, "json", id="json"),
        pytest.param("train", 0, "yaml", id="yaml"),
    ],
)
async def test_the_command(
    name: str, code: int, output: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with FakeApiServer() as fake:
        fake.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        fake.put(pod(limits=SHARE, phase="Running", node="node-a"))
        args = argparse.Namespace(
            pod=name,
            namespace=NS,
            output=output or "text",
            kubeconfig=fake.kubeconfig(tmp_path / "kubeconfig"),
            context=None,
        )
        assert await asyncio.to_thread(run, args) == code
    captured = capsys.readouterr()
    if code:
        assert "was never created" in captured.err
    else:
        assert "running" in captured.out
