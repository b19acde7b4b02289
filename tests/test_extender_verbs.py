"""filter and prioritize as tables: shares, memory, models on mixed nodes, whole cards,
unhealthy cards, the pod's own booking, Failed vs Unresolvable, messages without node names."""

from __future__ import annotations

from typing import Any

import pytest

from core.placement import ContainerPlacement
from extender.demand import DemandError, pod_demand
from extender.ledger import Booking, Ledger
from extender.verbs import View, filter_nodes, prioritize
from extender.view import NO_INVENTORY, node_cards
from extender.wire import ExtenderArgs
from testkit.extender import A100, L4, Gpu, node, pod

B = 96  # blocks of a 24 GiB card
NEVER = "no healthy card of the models the pod may use can hold"


def view(
    nodes: list[dict[str, Any]], bookings: dict[str, dict[str, Booking]] | None = None
) -> View:
    cards = {n["metadata"]["name"]: node_cards(n) for n in nodes}
    ledgers = {name: Ledger(name, b) for name, b in (bookings or {}).items()}
    products = {p for c in cards.values() if c for p in c.products.values()}
    return View(cards=cards.get, ledger=ledgers.get, models=lambda: products)


def booking(uuid: str, core: int, blocks: int, owner: str = "other") -> Booking:
    return Booking("team", owner, {"c0": ContainerPlacement((uuid,), core, blocks)})


def args(p: dict[str, Any], names: list[str]) -> ExtenderArgs:
    return ExtenderArgs.model_validate({"Pod": p, "NodeNames": names})


NODES = [
    node("l4", Gpu("L4-0"), Gpu("L4-1")),
    node("a100", Gpu("A-0", A100, 40 * 1024)),
    node("sick", Gpu("S-0", healthy=False)),
    node("bare", inventory=False),
    node("mixed", Gpu("M-0", L4), Gpu("M-1", A100, 40 * 1024)),
]
NAMES = ["l4", "a100", "sick", "bare", "mixed"]
HALF_L4 = {"l4": {"x": booking("L4-0", 60, 10), "y": booking("L4-1", 60, 10)}}

# (pod, bookings, passing nodes, failed {node: reason}, unresolvable {node: reason})
FILTER = [
    pytest.param(
        pod("p", (50, 32)),
        {},
        ["l4", "a100", "mixed"],
        {},
        {
            "sick": "no healthy card of the models the pod may use can hold 0.50 card and 8192 MiB",
            "bare": NO_INVENTORY,
        },
        id="a share: every healthy node with inventory",
    ),
    pytest.param(
        pod("p", (50, 32)),
        HALF_L4,
        ["a100", "mixed"],
        {"l4": "no single card has 0.50 card and 8192 MiB free"},
        {
            "sick": "no healthy card of the models the pod may use can hold 0.50 card and 8192 MiB",
            "bare": NO_INVENTORY,
        },
        id="core left on two cards but not on one: failed, not unresolvable",
    ),
    pytest.param(
        pod("p", (30, 150)),
        {},
        ["a100", "mixed"],
        {},
        {
            "l4": f"{NEVER} 0.30 card and 38400 MiB",
            "sick": f"{NEVER} 0.30 card and 38400 MiB",
            "bare": NO_INVENTORY,
        },
        id="memory larger than an L4: unresolvable there",
    ),
    pytest.param(
        pod("p", (50, 32), models=A100),
        {},
        ["a100", "mixed"],
        {},
        {
            "l4": "no card of the GPU models the pod chose",
            "sick": "no card of the GPU models the pod chose",
            "bare": NO_INVENTORY,
        },
        id="model choice: only A100 cards, on mixed nodes too",
    ),
    pytest.param(
        pod("p", (200, 0)),
        {},
        ["l4", "mixed"],
        {},
        {
            "a100": "fewer than 2 healthy cards of the models the pod may use",
            "sick": "fewer than 2 healthy cards of the models the pod may use",
            "bare": NO_INVENTORY,
        },
        id="two whole cards",
    ),
    pytest.param(
        pod("p", (200, 0), models=L4),
        {"l4": {"x": booking("L4-0", 1, 1)}},
        [],
        {"l4": "fewer than 2 cards entirely free"},
        {
            "a100": "no card of the GPU models the pod chose",
            "sick": "fewer than 2 healthy cards of the models the pod may use",
            "bare": NO_INVENTORY,
            "mixed": "fewer than 2 healthy cards of the models the pod may use",
        },
        id="whole cards stay whole: a used card is not entirely free",
    ),
    pytest.param(
        pod("p", (50, 32), uid="me"),
        {
            "l4": {"me": booking("L4-0", 50, 32, "p"), "y": booking("L4-1", 60, 10)},
            "a100": {"z": booking("A-0", 90, 10)},
            "mixed": {"z": booking("M-0", 90, 10), "w": booking("M-1", 90, 10)},
        },
        ["l4"],
        {
            "a100": "no single card has 0.50 card and 8192 MiB free",
            "mixed": "no single card has 0.50 card and 8192 MiB free",
        },
        {
            "sick": "no healthy card of the models the pod may use can hold 0.50 card and 8192 MiB",
            "bare": NO_INVENTORY,
        },
        id="the pod's own booking is left out: a retry fits where it is booked",
    ),
    pytest.param(
        pod("p", (60, 10), (60, 10)),
        {},
        ["l4", "mixed"],
        {},
        {
            "a100": "no healthy card of the models the pod may use can hold 0.60 card and 2560 MiB",
            "sick": "no healthy card of the models the pod may use can hold 0.60 card and 2560 MiB",
            "bare": NO_INVENTORY,
        },
        id="two containers: each on its own card, of any model",
    ),
]


@pytest.mark.parametrize(("p", "bookings", "passing", "failed", "never"), FILTER)
def test_filter(
    p: dict[str, Any],
    bookings: dict[str, dict[str, Booking]],
    passing: list[str],
    failed: dict[str, str],
    never: dict[str, str],
) -> None:
    result = filter_nodes(args(p, NAMES), view(NODES, bookings))
    assert result.node_names == passing
    assert result.failed_nodes == failed
    assert result.failed_and_unresolvable == never
    assert result.error == ""
    for reason in [*failed.values(), *never.values()]:
        assert not any(name in reason for name in NAMES)


def test_a_pod_without_gpu_passes_everywhere() -> None:
    p = pod("p")
    result = filter_nodes(args(p, NAMES), view(NODES))
    assert result.node_names == NAMES


def test_an_unplaceable_pod_is_unresolvable_everywhere() -> None:
    p = pod("p", (150, 0))
    result = filter_nodes(args(p, ["l4", "a100"]), view(NODES))
    assert result.node_names == []
    assert set(result.failed_and_unresolvable) == {"l4", "a100"}
    assert "whole number of cards" in result.failed_and_unresolvable["l4"]


def test_nodes_sent_as_objects_come_back_as_objects() -> None:
    body = {"Pod": pod("p", (50, 32)), "Nodes": {"items": NODES[:3]}}
    result = filter_nodes(ExtenderArgs.model_validate(body), view([]))
    assert result.nodes is not None
    assert [n["metadata"]["name"] for n in result.nodes.items] == ["l4", "a100"]
    assert result.node_names == ["l4", "a100"]


DEMAND_ERRORS = [
    pytest.param(
        {"initContainers": [{"name": "i", "resources": {"limits": {"fracgpu.io/core": "50"}}}]},
        "init container",
        id="init container",
    ),
    pytest.param(
        {"containers": [{"name": "c", "resources": {"limits": {"fracgpu.io/memory": "4"}}}]},
        "without fracgpu.io/core",
        id="memory without core",
    ),
    pytest.param(
        {"containers": [{"name": "c", "resources": {"limits": {"fracgpu.io/core": "x"}}}]},
        "not a whole",
        id="not a quantity",
    ),
]


@pytest.mark.parametrize(("spec", "why"), DEMAND_ERRORS)
def test_demand_errors(spec: dict[str, Any], why: str) -> None:
    with pytest.raises(DemandError, match=why):
        pod_demand({"metadata": {"name": "p"}, "spec": spec})


def test_containers_are_placed_whole_cards_first_then_largest() -> None:
    demand = pod_demand(pod("p", (10, 1), (100, 0), (60, 5)))
    assert [c.core for c in demand.containers] == [100, 60, 10]


PACK = {"l4": {"x": booking("L4-0", 40, 40)}}

# (policy, bookings, expected scores for l4, a100, sick)
PRIORITIZE = [
    pytest.param("pack", {}, [4, 4, 0], id="pack: empty nodes by the pod's own size"),
    pytest.param("pack", PACK, [8, 4, 0], id="pack: the partly used card scores higher"),
    pytest.param("spread", PACK, [2, 7, 0], id="spread: the inverse"),
    pytest.param(
        "spread",
        {"l4": {"me": booking("L4-0", 50, 32, "p")}},
        [10, 7, 0],
        id="the node holding the pod's booking: 10",
    ),
]


@pytest.mark.parametrize(("policy", "bookings", "scores"), PRIORITIZE)
def test_prioritize(
    policy: Any, bookings: dict[str, dict[str, Booking]], scores: list[int]
) -> None:
    p = pod("p", (50, 32), uid="me")
    result = prioritize(args(p, ["l4", "a100", "sick"]), view(NODES, bookings), policy)
    assert [s.host for s in result] == ["l4", "a100", "sick"]
    assert [s.score for s in result] == scores
