"""``kubectl fracgpu top`` and ``fit``: the cards of the cluster in both modes, the shape rules
as the webhook's, the order the device plugin places by, and the commands against the fake
API server."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from core import dra
from core.labels import FREE_ANNOTATION, FREE_VERSION, INVENTORY_ANNOTATION, INVENTORY_VERSION
from core.units import UnitError
from deviceplugin.shared.guardmetrics import GuardMetrics
from fracgpu.cards import (
    CardView,
    ClusterCards,
    Share,
    apply_live,
    device_plugin_cards,
    dra_cards,
)
from fracgpu.top import Shape, fitting, parse_shape, render_top, run_fit, run_top, why_none
from fracgpu.usage import LiveUse, parse
from testkit.apiserver import FakeApiServer

H100 = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize(
    ("gpu", "gpumem", "expected"),
    [
        pytest.param("0.5", "8Gi", Shape(50, 8192), id="share-with-memory"),
        pytest.param("0.3", None, Shape(30, None), id="share-memory-by-part"),
        pytest.param("0.5", "1000Mi", Shape(50, 1024), id="memory-rounds-up-to-the-block"),
        pytest.param("1", None, Shape(0, None, 1), id="one-whole-card"),
        pytest.param("2", None, Shape(0, None, 2), id="two-whole-cards"),
    ],
)
def test_a_shape_is_read_as_the_webhook_reads_it(
    gpu: str, gpumem: str | None, expected: Shape
) -> None:
    assert parse_shape(gpu, gpumem) == expected


@pytest.mark.parametrize(
    ("gpu", "gpumem", "count", "expected"),
    [
        pytest.param("0.3", "8Gi", 2, Shape(30, 8192, count=2), id="a-share-of-two-cards"),
        pytest.param("1", None, 3, Shape(0, None, 3), id="one-card-on-three-is-three-cards"),
    ],
)
def test_a_count_of_cards_is_read_as_fracgpu_io_gpu_count(
    gpu: str, gpumem: str | None, count: int, expected: Shape
) -> None:
    assert parse_shape(gpu, gpumem, count) == expected


@pytest.mark.parametrize(
    ("gpu", "count"),
    [pytest.param("0.3", 0, id="no-cards"), pytest.param("2", 2, id="whole-cards-and-a-count")],
)
def test_a_count_that_is_no_shape_is_refused(gpu: str, count: int) -> None:
    with pytest.raises(UnitError):
        parse_shape(gpu, None, count)


@pytest.mark.parametrize(
    ("gpu", "gpumem"),
    [
        pytest.param("1.5", None, id="more-than-one-card-not-whole"),
        pytest.param("0.333", None, id="three-decimals"),
        pytest.param("0", None, id="nothing"),
        pytest.param("2", "8Gi", id="whole-cards-with-memory"),
        pytest.param("0.5", "0", id="no-memory"),
        pytest.param("half", None, id="no-number"),
    ],
)
def test_what_is_no_shape_is_refused(gpu: str, gpumem: str | None) -> None:
    with pytest.raises(UnitError):
        parse_shape(gpu, gpumem)


def card(node: str, device: str, free: int, free_mib: int, healthy: bool = True) -> CardView:
    return CardView(node, device, H100, 81408, free, free_mib, healthy)


CARDS = [
    card("a", "gpu-0", 70, 60000),
    card("a", "gpu-1", 40, 70000),
    card("b", "gpu-0", 100, 81408),
    card("b", "gpu-1", 100, 81408),
    card("c", "gpu-0", 100, 81408, healthy=False),
]


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        pytest.param(Shape(30, 8192), ["a/gpu-1", "a/gpu-0", "b/gpu-0", "b/gpu-1"],
                     id="best-fit-first"),
        pytest.param(Shape(50, 65536), ["b/gpu-0", "b/gpu-1"], id="memory-decides"),
        pytest.param(Shape(50, None), ["a/gpu-0", "b/gpu-0", "b/gpu-1"],
                     id="memory-by-part-of-each-card"),
        pytest.param(Shape(0, None, 2), ["b/gpu-0", "b/gpu-1"], id="whole-cards-on-one-node"),
        pytest.param(Shape(0, None, 3), [], id="no-node-has-three"),
        pytest.param(Shape(30, 8192, count=2), ["a/gpu-1", "a/gpu-0", "b/gpu-0", "b/gpu-1"],
                     id="a-share-of-two-cards-on-nodes-with-two"),
        pytest.param(Shape(50, None, count=2), ["b/gpu-0", "b/gpu-1"],
                     id="a-share-of-two-cards-where-two-cards-of-one-node-have-room"),
    ],
)  # fmt: skip
def test_the_cards_that_fit_in_the_plugins_order(shape: Shape, expected: list[str]) -> None:
    assert [f"{c.node}/{c.device}" for c in fitting(shape, CARDS)] == expected


def test_why_none_is_the_waiting_pods_sentence() -> None:
    view = ClusterCards("dra", [card("a", "gpu-0", 40, 20480)])
    assert why_none(Shape(50, 8192), view) == (
        "largest free share on any node: 0.40 card and 20480 MiB on gpu-0 of a; this pod asks "
        "0.50 card and 8192 MiB"
    )


def test_why_a_share_of_two_cards_fits_nowhere() -> None:
    view = ClusterCards("dra", [card("a", "gpu-0", 40, 20480), card("a", "gpu-1", 10, 20480)])
    assert why_none(Shape(30, 8192, count=2), view) == (
        "cards of one node that could each take 0.30 card and 8192 MiB: at most 1 (on a); "
        "this pod asks 0.30 card and 8192 MiB on each of 2 cards"
    )


def dra_slice(node: str, cards: int) -> dict[str, Any]:
    devices = [
        {
            "name": f"gpu-{i}",
            "attributes": {
                dra.PRODUCT_ATTRIBUTE: {"string": H100},
                dra.UUID_ATTRIBUTE: {"string": f"GPU-{node}{i}"},
            },
            "capacity": {dra.CORES: {"value": "100"}, dra.MEMORY: {"value": "81408Mi"}},
        }
        for i in range(cards)
    ]
    return {"spec": {"driver": dra.DRIVER, "nodeName": node, "pool": {"name": node},
                     "devices": devices}}  # fmt: skip


def test_dra_cards_show_each_share_on_its_card() -> None:
    result = {"driver": dra.DRIVER, "pool": "a", "device": "gpu-1",
              "consumedCapacity": {dra.CORES: "30", dra.MEMORY: "8Gi"}}  # fmt: skip
    claim = {
        "metadata": {"name": "train-gpu-x", "namespace": "team-a"},
        "status": {"allocation": {"devices": {"results": [result]}},
                   "reservedFor": [{"resource": "pods", "name": "train", "uid": "u1"}]},
    }  # fmt: skip
    pod = {
        "metadata": {"name": "train", "namespace": "team-a", "uid": "u1"},
        "spec": {"containers": [{"name": "main", "resources": {"claims": [{"name": "gpu"}]}},
                                {"name": "sidecar"}]},
        "status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "train-gpu-x"}]},
    }  # fmt: skip
    cards = dra_cards([dra_slice("a", 2)], [claim], [pod])
    assert [(c.device, c.free_cores, c.free_mib) for c in cards] == [
        ("gpu-0", 100, 81408),
        ("gpu-1", 70, 81408 - 8192),
    ]
    assert cards[1].shares == [Share("team-a", "train", ("main",), 30, 8192)]


def dp_node(name: str) -> dict[str, Any]:
    inventory = {"version": INVENTORY_VERSION, "cards": [
        {"index": i, "uuid": f"GPU-{i}", "product": H100, "memoryMiB": 81559, "healthy": i == 0}
        for i in range(2)]}  # fmt: skip
    left = [{"index": 0, "cores": 50, "memoryMiB": 40960}, {"index": 1, "cores": 0, "memoryMiB": 0}]
    free = {"version": FREE_VERSION, "cards": left}
    annotations = {INVENTORY_ANNOTATION: json.dumps(inventory), FREE_ANNOTATION: json.dumps(free)}
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": annotations}}  # fmt: skip


def dp_pod(name: str, core: str, memory: str, node: str = "a") -> dict[str, Any]:
    limits = {"fracgpu.io/core": core, "fracgpu.io/memory": memory}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "team-a"},
            "spec": {"nodeName": node, "containers": [
                {"name": "main", "image": "x", "resources": {"limits": limits}}]},
            "status": {"phase": "Running"}}  # fmt: skip


def test_device_plugin_cards_and_their_nodes_shares() -> None:
    cards, unplaced = device_plugin_cards([dp_node("a")], [dp_pod("nb", "50", "32")])
    assert [(c.device, c.free_cores, c.free_mib, c.healthy) for c in cards] == [
        ("card 0", 50, 40960, True),
        ("card 1", 0, 0, False),
    ]
    assert unplaced == {"a": [Share("team-a", "nb", ("main",), 50, 8192)]}
    text = render_top(ClusterCards("device-plugin", cards, unplaced), wide=True)
    assert "team-a/nb (main): 0.50 card, 8192 MiB" in text
    assert "unhealthy" in text


def _args(tmp_path: Path, fake: FakeApiServer, **values: Any) -> argparse.Namespace:
    base = {"kubeconfig": fake.kubeconfig(tmp_path / "kubeconfig"), "context": None,
            "node": None, "namespace": None, "all_namespaces": False, "output": "json",
            "live": True, "count": 1}  # fmt: skip
    return argparse.Namespace(**(base | values))


@pytest.mark.parametrize(
    ("gpu", "count", "code", "fits"),
    [
        pytest.param("0.5", 1, 0, 1, id="fits"),
        pytest.param("0.6", 1, 1, 0, id="fits-nowhere"),
        pytest.param("0.1", 2, 1, 0, id="a-share-of-two-cards-needs-dra-mode"),
    ],
)
async def test_the_commands_against_the_api_server(
    *, gpu: str, count: int, code: int, fits: int, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    async with FakeApiServer() as fake:
        fake.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a"}})
        fake.put(dp_node("a"))
        fake.put(dp_pod("nb", "50", "32"))
        top = _args(tmp_path, fake)
        assert await asyncio.to_thread(run_top, top) == 0
        shown = json.loads(capsys.readouterr().out)
        assert (shown["mode"], len(shown["cards"])) == ("device-plugin", 2)
        fit = _args(tmp_path, fake, gpu=gpu, gpumem="8Gi", count=count)
        assert await asyncio.to_thread(run_fit, fit) == code
        answer = json.loads(capsys.readouterr().out)
        assert len(answer["fits"]) == fits
        assert bool(answer["why_not"]) == (fits == 0)


# ---- live use, from the node agents' metrics ---------------------------------------------


def agent_text() -> str:
    """What two node agents serve on /metrics: their real metrics objects, exposed by
    prometheus_client as Prometheus scrapes them."""
    text = ""
    for prefix, labels, used, busy in (
        ("fracgpu_device_plugin", ("team-a", "nb", "main", "GPU-0", "H100"), 3 << 30, 42.5),
        ("fracgpu_dra_plugin", ("team-a", "train", "side", "GPU-a1", 'H "x"'), 1 << 20, None),
    ):
        metrics = GuardMetrics(CollectorRegistry(), prefix)
        metrics.share_memory_used.labels(*labels).set(used)
        metrics.share_memory_granted.labels(*labels).set(8 << 30)
        if busy is not None:
            metrics.share_compute_used.labels(*labels).set(busy)
        metrics.guard_kills.labels("0").inc()
        text += generate_latest(metrics.registry).decode()
    return text


def test_the_agents_share_series_are_read() -> None:
    """Memory used and compute used per container and card; granted and other series are not
    live use; a card that does not sample has no compute figure (None, not 0)."""
    assert parse(agent_text()) == [
        LiveUse("team-a", "nb", "main", "GPU-0", 3072, 42.5),
        LiveUse("team-a", "train", "side", "GPU-a1", 1, None),
    ]


def test_dra_shares_get_their_use_on_their_card() -> None:
    view = ClusterCards("dra", dra_cards([dra_slice("a", 2)], [], []))
    view.cards[1].shares = [Share("team-a", "train", ("main",), 30, 8192)]
    uses = [
        LiveUse("team-a", "train", "main", "GPU-a1", 3000, 40.0),
        LiveUse("team-a", "train", "side", "GPU-a1", 100, 5.0),
        LiveUse("team-a", "train", "main", "GPU-a0", 999, 1.0),  # another card: not this share
    ]
    apply_live(view, uses)
    (share,) = view.cards[1].shares
    assert (share.used_mib, share.busy_percent) == (3100, 45.0)
    text = render_top(view, wide=False)
    assert "team-a/train (main): 0.30 card, 8192 MiB; using 3100 MiB, 45% of the SMs busy" in text


def test_device_plugin_shares_are_placed_on_the_card_their_agent_names() -> None:
    """The node agent's series name the card: a measured share is shown on it; a share with
    no processes yet stays among the node's shares."""
    cards, unplaced = device_plugin_cards(
        [dp_node("a")], [dp_pod("nb", "50", "32"), dp_pod("idle", "20", "8")]
    )
    view = apply_live(
        ClusterCards("device-plugin", cards, unplaced),
        [LiveUse("team-a", "nb", "main", "GPU-0", 2048, None)],
    )
    assert view.cards[0].shares == [
        Share("team-a", "nb", ("main",), 50, 8192, used_mib=2048, busy_percent=None)
    ]
    assert view.unplaced == {"a": [Share("team-a", "idle", ("main",), 20, 2048)]}
    assert "team-a/nb (main): 0.50 card, 8192 MiB; using 2048 MiB\n" in render_top(view, wide=False)


async def test_top_says_why_live_use_is_missing_and_shows_the_grants(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A node agent whose metrics cannot be read through the API server (here the proxy
    answers 404): top still answers, with the grants, and says on stderr what it could not
    read; --no-live does not ask."""
    agent = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "agent-a", "namespace": "fracgpu",
                     "labels": {"app.kubernetes.io/name": "fracgpu-device-plugin"}},
        "spec": {"nodeName": "a", "containers": [
            {"name": "device-plugin", "image": "x",
             "ports": [{"name": "metrics", "containerPort": 9402}]}]},
        "status": {"phase": "Running"},
    }  # fmt: skip
    async with FakeApiServer(namespaces=("default", "team-a", "fracgpu")) as fake:
        fake.put(dp_node("a"))
        fake.put(dp_pod("nb", "50", "32"))
        fake.put(agent)
        assert await asyncio.to_thread(run_top, _args(tmp_path, fake)) == 0
        captured = capsys.readouterr()
        assert json.loads(captured.out)["unplaced"]["a"][0]["pod"] == "nb"
        assert captured.err.startswith("fracgpu top: live use not shown: node agent pod ")
        assert await asyncio.to_thread(run_top, _args(tmp_path, fake, live=False)) == 0
        assert capsys.readouterr().err == ""
